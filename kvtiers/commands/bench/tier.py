"""The click side of :mod:`kvtiers.commands.bench.harness`: ``kvtiers bench tier TYPE`` and a factory for
per-tier aliases (``kvtiers bench fs`` and ``kvtiers bench obj`` are this command with the
tier fixed). Imports nothing heavy until a command runs."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import click

from kvtiers.config import parse_size


class _Parsed(click.ParamType):
    """A parameter whose text :meth:`parse` turns into its value; its ``ValueError`` is the
    usage error."""

    def parse(self, value: Any) -> Any:
        raise NotImplementedError

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            return self.parse(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class Size(_Parsed):
    """``1048576``, ``512K``, ``4MiB``, ``1.5G`` -> bytes (binary units; :func:`kvtiers.config.parse_size`).
    The ``SIZE`` options of every command, the plugins' included."""

    name = "SIZE"

    def parse(self, value: Any) -> int:
        return parse_size(value)


class Duration(_Parsed):
    """``90``, ``60s``, ``10m``, ``1h30m`` -> seconds."""

    name = "DURATION"

    def parse(self, value: Any) -> float:
        if isinstance(value, float):
            return value
        from .soak import parse_duration

        return parse_duration(value)


class JobsByKeys(click.ParamType):
    """``4x16``: 4 jobs in flight of 16 keys each."""

    name = "JOBSxKEYS"

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", str(value))
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            self.fail(f"{value!r} is not JOBSxKEYS (e.g. 4x16)", param, ctx)
        return int(m.group(1)), int(m.group(2))


def _options(default_chunk: tuple[str, ...], default_total: str, default_chunks: int | None) -> list[Callable]:
    return [
        click.option("--config", "config_text", default=None, metavar="JSON", help="The tier's options as JSON."),
        click.option("--config-file", type=click.Path(dir_okay=False, exists=True), default=None,
                     help="The tier's options from a JSON file."),
        click.option("--chunk-bytes", type=Size(), multiple=True, default=default_chunk, show_default=True,
                     help="Chunk size (repeatable)."),
        click.option("--total-bytes", type=Size(), default=default_total, show_default=True,
                     help="Bytes stored and loaded per round (chunks = total / chunk size)."),
        click.option("--chunks", type=click.IntRange(1), default=default_chunks,
                     help="Chunks per round instead of --total-bytes."),
        click.option("--rounds", type=click.IntRange(1), default=3, show_default=True,
                     help="Interleaved rounds; medians are compared."),
        click.option("--concurrency", type=JobsByKeys(), multiple=True, default=("1x1", "4x1", "1x16", "4x16"),
                     show_default=True, help="Jobs in flight x keys per job, at the first chunk size (repeatable)."),
        click.option("--no-concurrency", is_flag=True, help="Skip the concurrency sweep."),
        click.option("--keys-per-job", type=click.IntRange(1), default=64, show_default=True,
                     help="Keys per job of the chunk-size runs (all jobs submitted at once)."),
        click.option("--lookup-batch", type=click.IntRange(1), default=1000, show_default=True,
                     help="Keys per lookup call."),
        click.option("--no-baseline", is_flag=True, help="Do not measure the tier's raw baseline."),
        click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (no progress)."),
        click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, metavar="FILE.png",
                     help="Write GB/s against chunk size and concurrency as a PNG (needs matplotlib); "
                          "with --soak, the rows against time."),
        click.option("--soak", type=Duration(), default=None,
                     help="Soak instead: store, look up, load and evict at a bound for DURATION (90, 60s, 10m, "
                          "1h), a row per interval (chunk size: the first --chunk-bytes, 64K by default)."),
        click.option("--processes", type=click.IntRange(1), default=1, show_default=True,
                     help="With --soak: processes on one backend."),
        click.option("--interval", type=Duration(), default=None,
                     help="With --soak: seconds per row [default: 10s, a quarter of a shorter soak]."),
        click.option("--max-bytes", "soak_max_bytes", type=Size(), default=None,
                     help="With --soak: the bound (the tier's max_bytes) [default: the config's, else 256 chunks]."),
    ]


def run_command(tier_type: str, kw: dict[str, Any], variants: dict[str, dict[str, Any]] | None = None,
                post: Callable[[dict[str, Any]], None] | None = None,
                runs: dict[str, dict[str, Any]] | None = None) -> None:
    """Run the bench for the parsed options ``kw`` of a bench command; print the report.
    ``runs``: label -> option overrides, each measured by a harness run of its own (so with
    its own baseline), one after the other; their rows carry ``variant`` (the label)."""
    from ...config import parse_json_option
    from ...errors import ConfigError, TierError
    from ...registry import get_registry
    from ..progress import Progress
    from .harness import format_table, run_tier_bench, steps

    options = parse_json_option(kw["config_text"], kw["config_file"])
    options.pop("type", None)
    get_registry().tier_info(tier_type)  # an unknown type is an error before anything runs
    if kw["plot_path"]:  # matplotlib missing: said before the run, not after it
        from ..plot import require_plot

        require_plot()
    if kw.get("soak") is not None:
        many = [d for d in (variants, runs) if d and len(d) > 1]
        if many:
            raise ConfigError(f"--soak measures one configuration of the tier, not {len(many[0])}: choose one")
        over = {**next(iter((variants or {"": {}}).values())), **next(iter((runs or {"": {}}).values()))}
        run_soak_command(tier_type, {**options, **over}, kw)
        return
    for opt, given in (("processes", kw.get("processes", 1) != 1), ("interval", kw.get("interval") is not None),
                       ("max-bytes", kw.get("soak_max_bytes") is not None)):
        if given:
            raise ConfigError(f"--{opt} goes with --soak")
    conc = () if kw["no_concurrency"] else tuple(kw["concurrency"])
    sizes = list(kw["chunk_bytes"])
    runs = runs or {"": {}}
    total = steps(sizes, kw["rounds"], conc) * len(runs)
    reports: dict[str, dict[str, Any]] = {}
    with Progress(total, f"bench {tier_type}", quiet=kw["as_json"]) as bar:
        try:
            for label, over in runs.items():
                reports[label] = run_tier_bench(
                    tier_type, {**options, **over}, chunk_sizes=sizes, total_bytes=kw["total_bytes"],
                    chunks=kw["chunks"], rounds=kw["rounds"], concurrency=conc, keys_per_job=kw["keys_per_job"],
                    lookup_batch=kw["lookup_batch"], baseline=not kw["no_baseline"], variants=variants,
                    progress=bar,
                )
        except ConfigError as e:  # one line, `kvtiers: error: ...`, exit 2, as everywhere
            raise ConfigError(f"{e} (give the tier's options with --config JSON or --config-file F)") from None
        except TierError:  # a tier that cannot open (an unreachable backend): the same line
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None
        except RuntimeError as e:  # a failed or lost job: the tier's fault, said in one line
            raise TierError(str(e)) from None
    report = merge_reports(reports) if len(reports) > 1 or "" not in reports else reports[""]
    if post is not None:
        post(report)
    if kw["plot_path"]:
        from ..plot import plot_bench

        plot_bench(report, kw["plot_path"])
    if kw["as_json"]:
        click.echo(json.dumps(report, indent=1))
    else:
        click.echo(format_table(report))
        if kw["plot_path"]:
            click.echo(f"plot written to {kw['plot_path']}")


def run_soak_command(tier_type: str, options: dict[str, Any], kw: dict[str, Any]) -> None:
    """``--soak``: run :func:`kvtiers.commands.bench.soak.run_soak`, print a row per interval
    as it completes (or the JSON report at the end), the summary, and the plot."""
    from ...errors import ConfigError
    from ..progress import bar_only
    from .soak import format_header, format_row, format_summary, run_soak

    if kw["plot_path"]:  # before the soak, not after it
        from ..requires import require

        require("--plot", "matplotlib")
    src = click.get_current_context(silent=True)
    default_chunk = src is not None and src.get_parameter_source("chunk_bytes") is click.core.ParameterSource.DEFAULT
    chunk = 64 << 10 if default_chunk else kw["chunk_bytes"][0]
    state: dict[str, Any] = {"n": 0}
    bar = bar_only(None, f"soak {tier_type}", quiet=kw["as_json"])

    def on_row(row: dict[str, Any]) -> None:
        if kw["as_json"]:
            return
        bar.clear()
        if state["n"] == 0:
            click.echo(format_header(state["report"]))
        click.echo(format_row(row))
        state["n"] += 1
        bar.advance(note=f"t {row['t']:.0f} s")

    def header(report: dict[str, Any]) -> None:
        state["report"] = report

    try:
        report = run_soak(tier_type, options, duration=kw["soak"], interval=kw["interval"],
                          processes=kw["processes"], chunk_bytes=chunk, max_bytes=kw["soak_max_bytes"],
                          keys_per_job=kw["keys_per_job"], lookup_batch=kw["lookup_batch"], on_row=on_row,
                          on_start=header)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    finally:
        bar.close()
    if kw["plot_path"]:
        from .soak_plot import plot_soak

        plot_soak(report, kw["plot_path"])
    if kw["as_json"]:
        click.echo(json.dumps(report, indent=1))
    else:
        if state["n"] == 0:
            click.echo(format_header(report))
        click.echo(format_summary(report))
        if kw["plot_path"]:
            click.echo(f"plot written to {kw['plot_path']}")
    s = report["summary"]
    if s.get("wrong") or s.get("store_failed"):  # rule 3 and rule 11: the soak failed, whatever the rates
        from ...errors import TierError

        raise TierError(f"soak: {s['wrong']} load(s) returned bytes that were not the ones stored, "
                        f"{s['store_failed']} store(s) failed: {'; '.join(report['errors'][:3])}")


def merge_reports(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One report of several harness runs (label -> report): every row gets ``variant``
    (the label, or ``label/variant`` where the row had one); ``baseline`` names each run's."""
    first = next(iter(reports.values()))
    names = {label: r["baseline"] for label, r in reports.items()}
    merged: dict[str, Any] = {**first, "baseline": "; ".join(f"{k}: {v}" for k, v in names.items() if v) or None}
    for part in ("results", "concurrency", "lookup", "submit_latency_us"):
        merged[part] = []
        for label, r in reports.items():
            for row in r[part]:
                merged[part].append({**row, "variant": f"{label}/{row['variant']}" if row.get("variant") else label})
    return merged


def bench_command(name: str, tier_type: str | None, help_text: str, *,
                  default_chunk: tuple[str, ...] = ("1MiB", "4MiB"), default_total: str = "256MiB",
                  default_chunks: int | None = None,
                  extra: list[Callable] | None = None,
                  variants_from: Callable[[dict[str, Any]], dict[str, dict[str, Any]] | None] | None = None,
                  post: Callable[[dict[str, Any]], None] | None = None,
                  runs_from: Callable[[dict[str, Any]], dict[str, dict[str, Any]] | None] | None = None,
                  ) -> click.Command:
    """A ``kvtiers bench`` command: ``tier TYPE`` when ``tier_type`` is None, else an alias
    with the tier fixed. ``extra``: more click options; ``variants_from(kwargs)`` turns
    them into variants (name -> option overrides, measured in the same rounds against one
    baseline); ``runs_from(kwargs)`` into runs (label -> option overrides, one harness run
    each, each against its own baseline); ``post(report)`` may adjust the report."""

    def cmd(**kw: Any) -> None:
        ttype = kw.pop("tier_type", None) or tier_type
        variants = variants_from(kw) if variants_from else None
        runs = runs_from(kw) if runs_from else None
        run_command(ttype, kw, variants, post, runs)

    cmd.__doc__ = help_text
    for opt in reversed([*_options(default_chunk, default_total, default_chunks), *(extra or [])]):
        cmd = opt(cmd)
    if tier_type is None:
        cmd = click.argument("tier_type", metavar="TYPE")(cmd)
    return click.command(name, help=help_text)(cmd)


def _variants_from(kw: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """``--variant NAME=JSON`` (repeated) -> name -> option overrides over ``--config``."""
    from ...errors import ConfigError

    given = kw.pop("variant", ())
    if not given:
        return None
    out: dict[str, dict[str, Any]] = {}
    for text in given:
        name, sep, body = text.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ConfigError(f"--variant {text!r}: give NAME=JSON, e.g. --variant 'encrypted={{\"encrypt\": ...}}'")
        if name in out:
            raise ConfigError(f"--variant {name!r} is given twice")
        try:
            over = json.loads(body) if body.strip() else {}
        except json.JSONDecodeError as e:
            raise ConfigError(f"--variant {name!r}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(over, dict):
            raise ConfigError(f"--variant {name!r}: the JSON must be an object of tier options")
        out[name] = over
    return out


tier = bench_command(
    "tier", None,
    "Store and load GB/s of tier TYPE by chunk size and by concurrency, lookup rate and submit "
    "latency, against the tier's raw baseline on the same medium (where it offers one), in one run. "
    "Without --config, a tier with a conformance_config gets a scratch instance. --variant "
    "NAME=JSON (repeatable) measures several option sets of the tier in the same rounds, e.g. "
    "--variant plain={} --variant 'encrypted={\"encrypt\": {\"key_file\": \"/etc/kvtiers/key\"}}'.",
    extra=[click.option("--variant", multiple=True, metavar="NAME=JSON",
                        help="A named set of option overrides over --config, measured in the same rounds "
                             "as the others against one baseline (repeatable).")],
    variants_from=_variants_from,
)
