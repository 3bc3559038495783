"""``kvtiers bench serve``: the offloading curve on a real ``vllm serve``, driven by vLLM's own client.

Per configuration — ``none`` (no offloading), ``host`` (kvtiers' host arena only, empty
``secondary_tiers``), the arena plus each kvtiers tier named (``fs``, ``obj``, ``p2p``,
``mooncake``, any installed tier) and ``vllm-fs`` (vLLM's own fs tier under the same spec, the
peer) — it starts ``vllm serve`` on 127.0.0.1 with the tiny local model and vLLM's device
cache held to ``--gpu-blocks`` blocks, and runs ``vllm bench serve --dataset-name
prefix_repetition`` against it for every working set (``--prefixes``) and concurrency. Each
configuration's server is fresh (its tiers too); configurations are interleaved, the whole
round repeated ``--repeats`` times. Per cell: req/s, output tok/s, TTFT mean/median/p99, failed
requests (from the client's ``--save-result`` JSON); prompt tokens by source, per-tier chunk
hits and bytes, promotion allocation failures and lookup waits (from the server's /metrics
before and after); the machine's load. After its cells each server answers a few fixed greedy
prompts: their tokens must be the same under every configuration.

``--workloads prefix,multi-turn`` also drives each server with vLLM's own multi-turn client
(:mod:`.serve_multiturn`, a cell per number of conversations and concurrency);
``--variant NAME=CONFIG:JSON`` adds a copy of a configuration with other spec options
(:mod:`.serve_variants`), measured in the same interleaved rounds.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import click

from . import serve_identity
from . import serve_metrics as sm
from . import serve_multiturn as mtc
from . import serve_run as sr
from . import serve_variants as sv

__all__ = ["run_bench_serve", "serve"]

BENCH_FIELDS = ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "completed", "failed", "duration")
#: the workloads: vLLM's ``vllm bench serve`` prefix repetition, vLLM's multi-turn client
WORKLOADS = ("prefix", "multi-turn")
#: what a named model shape (``--model NAME``, :data:`kvtiers.commands.tinymodel.SHAPES`) changes in
#: the options left at their defaults: SmolLM2-135M's shape has 22.5 MiB of KV per 1024-token
#: prefix, so 24 device blocks of 128 tokens hold 2 prompts, a 256 MiB arena 11 prefixes
SHAPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"prefix_len": 1024, "gpu_blocks": 24, "cpu_bytes": 256 << 20, "tier_cpu_bytes": 256 << 20,
                     "prefixes": "2,8,24", "conversation_prefix_len": 1024},
}


def resolve_model(model: str | None) -> tuple[str, str | None]:
    """``--model``: a shape name (made on first use), a model directory, or None (the tiny
    Llama); the directory and the shape's name (None for a directory). ``ValueError``: neither."""
    from ..tinymodel import SHAPES, make_named_model, make_tiny_model

    if model is None:
        return str(make_tiny_model()), None
    if model.lower() in SHAPES:
        return str(make_named_model(model)), model.lower()
    if os.path.isdir(model):
        return model, None
    raise ValueError(f"--model {model!r} is neither a model shape ({', '.join(sorted(SHAPES))}) nor a directory")


def shape_defaults(shape: str | None, given: dict[str, Any], is_default: Any) -> dict[str, Any]:
    """``given`` (option -> value) with a shape's defaults (:data:`SHAPE_DEFAULTS`) for the
    options ``is_default(name)`` says the user left alone."""
    out = dict(given)
    for k, v in SHAPE_DEFAULTS.get(shape or "", {}).items():
        if k in out and is_default(k):
            out[k] = v
    return out


@dataclass
class Workloads:
    """What a run drives each server with: its cells ``(workload, size, concurrency)`` in order
    (size: prefixes, or conversations), and the multi-turn client where that workload runs."""

    cells: list[tuple[str, int, int]]
    multi_turn: mtc.MultiTurnSettings | None = None
    client: Any = None  # the multi-turn client's folder
    fit_requests: int = 0  # at least this many requests in each cell of the smallest working set

    def per_prefix(self, settings: sr.ServeSettings, prefixes: int) -> int:
        """Requests per prefix of a prefix cell: the settings', or more at the smallest working set."""
        fit = min((p for w, p, _ in self.cells if w == "prefix"), default=prefixes)
        if prefixes == fit and self.fit_requests:
            return max(settings.per_prefix, -(-self.fit_requests // prefixes))
        return settings.per_prefix

    def ceiling_blocks(self, settings: sr.ServeSettings) -> int:
        """Device blocks of the ``ceiling`` configuration: the largest working set and concurrency."""
        most = max((p for w, p, _ in self.cells if w == "prefix"), default=0)
        conc = max((c for _, _, c in self.cells), default=1)
        convs = max((n for w, n, _ in self.cells if w == "multi-turn"), default=0)
        mt = self.multi_turn
        conv_tokens = convs * mt.max_model_len if mt is not None else 0
        return sr.ceiling_blocks(settings, most, conc, conv_tokens)


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{what}: {text!r} is not a comma-separated list of integers") from None
    if not vals or min(vals) < 1:
        raise click.BadParameter(f"{what}: {text!r} must name at least one integer, each >= 1")
    return vals


def _one_server(cfg: sr.Config, repeat: int, settings: sr.ServeSettings, work: Workloads,
                workdir: str, tier_extra: dict[str, dict[str, Any]], bar: Any) -> dict[str, Any]:
    """Start ``cfg``'s server (and tier servers), run its cells and the greedy prompts, stop it."""
    from ...integrations.vllm.shm_region import sweep_stale_regions

    wd = os.path.join(workdir, f"{cfg.name}-r{repeat}")
    os.makedirs(wd, exist_ok=True)
    run: dict[str, Any] = {"config": cfg.name, "repeat": repeat, "cells": []}
    if cfg.base is not None:
        run["variant"] = sv.describe(cfg)
    log = os.path.join(wd, "server.log")
    if cfg.name == "ceiling":
        settings = replace(settings, gpu_blocks=work.ceiling_blocks(settings))
        run["gpu_blocks"] = settings.gpu_blocks
    with contextlib.ExitStack() as stack:
        ktc = sr.server_config(cfg, settings, wd, stack, tier_extra)
        run["kv_transfer_config"] = ktc
        srv = sr.VllmServer(settings, ktc, log)
        t0 = time.monotonic()
        srv.start(timeout=settings.start_timeout)
        stack.callback(srv.stop)
        sr.warm_up(srv.base_url, settings.model)
        run["start_s"] = time.monotonic() - t0
        bar.advance(note=f"{cfg.name} r{repeat}: server up in {run['start_s']:.0f} s")
        try:
            for i, (workload, prefixes, conc) in enumerate(work.cells):
                seed = 1000 + i  # the same prompts in every configuration and repeat
                before = sm.scrape(srv.base_url)
                load0 = sr.load_now()
                if workload == "multi-turn":
                    res = mtc.run_client(work.client, srv.base_url, settings.model, work.multi_turn, prefixes, conc,
                                         seed, wd, os.path.join(wd, "multi-turn.log"), settings.bench_timeout)
                else:
                    cell_settings = replace(settings, per_prefix=work.per_prefix(settings, prefixes))
                    res = sr.bench_cell(srv.base_url, cell_settings, prefixes, conc, seed,
                                        os.path.join(wd, f"bench-p{prefixes}-c{conc}.json"),
                                        os.path.join(wd, "bench.log"))
                time.sleep(1.0)  # the last step's stats reach the API server
                cell = {"workload": workload, "prefixes": prefixes, "concurrency": conc, "seed": seed,
                        "bench": {k: res.get(k) for k in BENCH_FIELDS}, "load": [load0, sr.load_now()]}
                run["cells"].append(cell)
                after = sm.scrape(srv.base_url)
                d = sm.delta(before, after)
                cell["metrics"] = sm.summarize(d, gauges=after)  # gauges: the reuse ceiling as it stands
                cell["metrics_delta"] = {k: v for k, v in d.items() if "kv_offload" in k or "kvtiers" in k
                                         or "prompt_tokens" in k or "prefix_cache" in k}
                size = "conversations" if workload == "multi-turn" else "prefixes"
                bar.advance(note=f"{cfg.name} r{repeat} {workload} {prefixes} {size} C={conc}: "
                                 f"{res.get('request_throughput', 0):.2f} req/s")
            run["greedy"], run["greedy_logprobs"] = sr.greedy_answers(
                srv.base_url, settings.model, sr.greedy_prompts(settings), settings.output_len,
                top_k=serve_identity.TOP_K)
        except OSError as e:  # the server stopped answering: say why, and go on with the next one
            if srv.alive() and not sr.engine_error(log):
                raise
            run["error"] = f"vllm serve ({cfg.name}, repeat {repeat}) died: {sr.engine_error(log) or e} (log {log})"
            for c in run["cells"]:
                c.setdefault("metrics", sm.summarize({}))
            bar.note(run["error"])
    left = sr.wait_gone(sr.shm_regions(log))
    run["shm_left"] = sorted(left)
    for p in left:  # this server's: reported, then removed unless some process still holds it
        sweep_stale_regions(pattern=p)
    return run


def _aggregate(report: dict[str, Any]) -> None:
    """Per (configuration, prefixes, concurrency): medians over repeats, ranges, fractions."""
    rows: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
    for run in report["runs"]:
        for c in run["cells"]:
            rows.setdefault((run["config"], c.get("workload", "prefix"), c["prefixes"], c["concurrency"]),
                            []).append(c)
    fits = {w: min(p for (_, w2, p, _) in rows if w2 == w) for (_, w, _, _) in rows}
    out = []
    for (name, w, p, conc), cells in rows.items():
        rps = [c["bench"]["request_throughput"] or 0.0 for c in cells]
        row: dict[str, Any] = {"config": name, "workload": w, "prefixes": p, "concurrency": conc,
                               "repeats": len(cells),
                               "req_s": statistics.median(rps), "req_s_range": [min(rps), max(rps)]}
        for k in ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms"):
            row[k] = statistics.median([c["bench"][k] or 0.0 for c in cells])
        row["failed"] = sum(c["bench"]["failed"] or 0 for c in cells)
        row["completed"] = sum(c["bench"]["completed"] or 0 for c in cells)
        m = [c["metrics"] for c in cells]
        row["prompt_tokens"] = _mean_dicts([x["prompt_tokens"] for x in m])
        row["cached_by_source"] = _mean_dicts([x["cached_by_source"] for x in m])
        row["tiers"] = {t: _mean_dicts([x["tiers"].get(t, {}) for x in m])
                        for t in sorted({t for x in m for t in x["tiers"]})}
        for k in ("promotion_alloc_failures", "lookup_async_delay_s", "lookup_async_waits"):
            row[k] = statistics.mean(x[k] for x in m)
        row["load"] = statistics.mean(c["load"][1] for c in cells)
        out.append(row)
    ref = {(r["workload"], r["concurrency"]): r["req_s"] for r in out
           if r["config"] == "none" and r["prefixes"] == fits[r["workload"]]}
    for r in out:
        own = next((x["req_s"] for x in out if x["config"] == r["config"] and x["workload"] == r["workload"]
                    and x["prefixes"] == fits[r["workload"]] and x["concurrency"] == r["concurrency"]), None)
        base = ref.get((r["workload"], r["concurrency"]), own)
        r["fraction_of_fit"] = (r["req_s"] / base) if base else None
    _ratios(out)
    report["fit"] = {"prefixes": fits.get("prefix", min(report["prefixes"])), "reference": "none" if ref else "own",
                     "by_workload": fits}
    order = {n: i for i, n in enumerate(report["configs"])}
    worder = {w: i for i, w in enumerate(WORKLOADS)}
    report["cells"] = sorted(out, key=lambda r: (worder.get(r["workload"], 9), r["concurrency"], r["prefixes"],
                                                 order[r["config"]]))


#: the ratios of a cell: to no offloading, to the all-in-device ceiling, kvtiers' fs to vLLM's fs
RATIOS = (("vs_none", "none"), ("vs_ceiling", "ceiling"))


def _ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's req/s over that of ``none`` and ``ceiling`` in the same cell (workload, size,
    concurrency), and for ``fs`` over ``vllm-fs``: medians over repeats, None where absent."""
    by = {(r["config"], r["workload"], r["prefixes"], r["concurrency"]): r["req_s"] for r in rows}
    for r in rows:
        cell = (r["workload"], r["prefixes"], r["concurrency"])
        for key, other in RATIOS:
            base = by.get((other, *cell))
            r[key] = (r["req_s"] / base) if base else None
        peer = by.get(("vllm-fs", *cell)) if r["config"] == "fs" else None
        r["vs_vllm_fs"] = (r["req_s"] / peer) if peer else None


def _mean_dicts(ds: list[dict[str, Any]]) -> dict[str, Any]:
    keys = sorted({k for d in ds for k in d})
    out: dict[str, Any] = {}
    for k in keys:
        vals = [d.get(k, 0.0) for d in ds]
        out[k] = _mean_dicts([v if isinstance(v, dict) else {} for v in vals]) if any(
            isinstance(v, dict) for v in vals) else statistics.mean(vals)
    return out


def _identity(report: dict[str, Any]) -> None:
    serve_identity.identity(report)


def _soak_out(rep: dict[str, Any], plot_file: str | None, as_json: bool) -> None:
    from . import serve_soak

    rep["summary"] = serve_soak.summarize(rep)  # from the intervals (a saved report: by this version's rules)
    if plot_file:
        from .serve_soak_plot import plot_serve_soak

        plot_serve_soak(rep, plot_file)
    click.echo(json.dumps(rep) if as_json else serve_soak.render(rep))


def _soak_command(soak: str, interval: str, rate: float, servers: int, prefixes: int, fs_max_bytes: int,
                  concurrency: str, model: str | None, prefix_len: int, suffix_len: int, output_len: int,
                  gpu_blocks: int, tier_cpu_bytes: int, serve_args: tuple[str, ...], workdir: str | None,
                  plot_file: str | None, as_json: bool) -> None:
    """``--soak``: check the arguments (one line each), run :func:`.serve_soak.run_serve_soak`,
    print and plot it; exit 1 unless it is OK."""
    from . import serve_report, serve_soak
    from .soak import parse_duration

    try:
        duration_s = parse_duration(soak)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--soak") from None
    try:
        interval_s = parse_duration(interval)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--interval") from None
    if interval_s > duration_s:
        raise click.BadParameter(f"{interval!r} is longer than the soak ({soak!r})", param_hint="--interval")
    conc = max(_ints(concurrency, "--concurrency"))
    from ..tinymodel import SHAPES

    if model is not None and model.lower() not in SHAPES and not os.path.isdir(model):
        raise click.BadParameter(f"{model!r} is neither a model shape ({', '.join(sorted(SHAPES))}) nor a directory",
                                 param_hint="--model")
    ctx = click.get_current_context()
    shape = model.lower() if model is not None and model.lower() in SHAPES else None
    opts = shape_defaults(shape, {"prefix_len": prefix_len, "gpu_blocks": gpu_blocks,
                                  "tier_cpu_bytes": tier_cpu_bytes},
                          lambda k: ctx.get_parameter_source(k) is click.core.ParameterSource.DEFAULT)
    if plot_file:
        serve_report.require_plot()
    from ..requires import require

    require("kvtiers bench serve --soak", "vllm")
    model_dir, _ = resolve_model(model)
    settings = sr.ServeSettings(model=model_dir, prefix_len=opts["prefix_len"], suffix_len=suffix_len,
                                output_len=output_len, gpu_blocks=opts["gpu_blocks"],
                                tier_cpu_bytes=opts["tier_cpu_bytes"], extra_serve_args=list(serve_args))
    ss = serve_soak.SoakSettings(duration_s=duration_s, interval_s=interval_s, rate=rate, max_concurrency=conc,
                                 prefixes=prefixes, servers=servers, fs_max_bytes=fs_max_bytes)
    rep = serve_soak.run_serve_soak(settings, ss, workdir=workdir,
                                    say=None if as_json else (lambda m: click.echo(m, err=True)))
    _soak_out(rep, plot_file, as_json)
    if not rep["summary"]["ok"]:
        sys.exit(1)


def _tier_extra(tier_config: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``--tier-config NAME=JSON`` items as ``{name: keys}``; one-line error for a bad one."""
    extra: dict[str, dict[str, Any]] = {}
    for item in tier_config:
        name, eq, text = item.partition("=")
        try:
            val = json.loads(text) if eq else None
        except json.JSONDecodeError:
            val = None
        if not isinstance(val, dict):
            raise click.BadParameter(f"{item!r} is not NAME=JSON-object", param_hint="--tier-config")
        extra[name.strip()] = val
    return extra


def _long_command(lengths: str, requests: int, rounds: int, tiers: str, repeats: int, model: str | None,
                  suffix_len: int, output_len: int, gpu_blocks: int, tier_cpu_bytes: int, tier_config: tuple[str, ...],
                  serve_args: tuple[str, ...], workdir: str | None, as_json: bool) -> None:
    """``--long``: check the arguments (one line each), run :func:`.serve_long.run_long` with
    ``none`` and the first of ``--tiers``, print it; exit 1 unless it is OK."""
    from ..tinymodel import SHAPES
    from . import serve_long

    n_list = _ints(lengths, "--long")
    tier = next((t.strip() for t in tiers.split(",") if t.strip()), None)
    if tier is None:
        raise click.BadParameter("--long needs a tier to load from: --tiers names none", param_hint="--tiers")
    try:
        sr.check_tier(tier)
        if tier in sr.BUILTIN:
            raise ValueError(f"--long loads from a kvtiers tier, not {tier!r}")
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--tiers") from None
    extra = _tier_extra(tier_config)
    if model is not None and model.lower() not in SHAPES and not os.path.isdir(model):
        raise click.BadParameter(f"{model!r} is neither a model shape ({', '.join(sorted(SHAPES))}) nor a directory",
                                 param_hint="--model")
    ctx = click.get_current_context()
    given = {k: (None if ctx.get_parameter_source(k) is click.core.ParameterSource.DEFAULT else v)
             for k, v in (("gpu_blocks", gpu_blocks), ("tier_cpu_bytes", tier_cpu_bytes))}
    from ..requires import require

    require("kvtiers bench serve --long", "vllm")
    model_dir, _ = resolve_model(model)
    ls = serve_long.LongSettings(lengths=n_list, requests=requests, tier=tier, rounds=rounds)
    base = sr.ServeSettings(model=model_dir, suffix_len=suffix_len, output_len=output_len,
                            extra_serve_args=list(serve_args))
    try:
        settings = serve_long.sized(base, ls, given["gpu_blocks"], given["tier_cpu_bytes"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--gpu-blocks/--tier-cpu-bytes") from None
    rep = serve_long.run_long(sr.configs_for(["none", tier]), settings, ls, repeats, workdir=workdir,
                              tier_extra=extra, say=lambda m: click.echo(m, err=True))
    click.echo(json.dumps(rep) if as_json else serve_long.render(rep))
    if not serve_long.ok(rep):
        sys.exit(1)


def _saved(path: str) -> dict[str, Any]:
    """A report saved with ``--json``; a clear error if the file is not one."""
    try:
        with open(path) as f:
            rep = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise click.BadParameter(f"{path}: not a JSON report ({e})", param_hint="--report") from None
    if isinstance(rep, dict) and rep.get("kind") == "serve-soak" and {"intervals", "summary", "soak"} <= rep.keys():
        return rep
    if isinstance(rep, dict) and rep.get("kind") == "serve-long" and {"cells", "runs", "identity"} <= rep.keys():
        return rep
    if not isinstance(rep, dict) or not {"cells", "runs", "identity", "settings"} <= rep.keys():
        raise click.BadParameter(f"{path}: not a report of kvtiers bench serve --json", param_hint="--report")
    return rep


def run_bench_serve(configs: list[sr.Config], settings: sr.ServeSettings, prefixes: list[int],
                    concurrency: list[int], repeats: int, *, workdir: str | None = None,
                    tier_extra: dict[str, dict[str, Any]] | None = None, quiet: bool = False,
                    workloads: Sequence[str] = ("prefix",), conversations: Sequence[int] = (),
                    multi_turn: mtc.MultiTurnSettings | None = None, client: Any = None,
                    fit_requests: int = 0) -> dict[str, Any]:
    """Run the sweep; the report (see :func:`kvtiers.commands.bench.serve_report.render`).
    ``workloads``: ``prefix`` (a cell per prefixes x concurrency) and ``multi-turn`` (a cell per
    conversations x concurrency, vLLM's multi-turn client in folder ``client``)."""
    from ..progress import Progress

    own = workdir is None
    wd = tempfile.mkdtemp(prefix="kvtiers-bench-serve-") if own else workdir
    os.makedirs(wd, exist_ok=True)
    cells = [("prefix", p, c) for p in prefixes for c in concurrency] if "prefix" in workloads else []
    work = Workloads(cells, fit_requests=fit_requests)
    if "multi-turn" in workloads:
        work.multi_turn = multi_turn or mtc.MultiTurnSettings(output_len=settings.output_len)
        work.client = client if client is not None else mtc.client_dir()
        cells += [("multi-turn", n, c) for n in conversations for c in concurrency]
        template = os.path.join(wd, "chat-template.jinja")
        with open(template, "w") as f:
            f.write(mtc.CHAT_TEMPLATE)
        settings = replace(settings, multi_turn_len=work.multi_turn.max_model_len,
                           extra_serve_args=[*settings.extra_serve_args, "--chat-template", template])
    report: dict[str, Any] = {
        "engine": "vllm serve", "model": settings.model, "configs": [c.name for c in configs], "prefixes": prefixes,
        "concurrency": concurrency, "repeats": repeats, "workloads": list(workloads),
        "conversations": list(conversations) if "multi-turn" in workloads else [],
        "settings": {"prefix_len": settings.prefix_len, "suffix_len": settings.suffix_len,
                     "output_len": settings.output_len, "requests_per_prefix": settings.per_prefix,
                     "gpu_blocks": settings.gpu_blocks, "cpu_bytes": settings.cpu_bytes,
                     "tier_cpu_bytes": settings.tier_cpu_bytes, "max_model_len": settings.max_model_len,
                     "fit_requests": fit_requests,
                     "multi_turn": work.multi_turn.as_dict() if work.multi_turn else None},
        "variants": {c.name: sv.describe(c) for c in configs if c.base is not None},
        "runs": []}
    with sr.measuring(wd, own, report):
        with Progress(repeats * len(configs) * (1 + len(cells)), "bench serve", quiet=quiet) as bar:
            for r in range(repeats):
                for cfg in configs:
                    report["runs"].append(_one_server(cfg, r, settings, work, wd, tier_extra or {}, bar))
    _aggregate(report)
    _identity(report)
    return report


@click.command(name="serve")
@click.option("--tiers", default="fs", show_default=True,
              help="kvtiers tiers to measure, each behind the host arena (fs, obj, p2p, mooncake, any "
                   "installed tier); '' for none.")
@click.option("--peer/--no-peer", default=True, show_default=True,
              help="Also measure vLLM's own fs tier (vllm-fs) under the same spec.")
@click.option("--configs", default=None,
              help="The configurations, in order, instead of none,host,<tiers>,vllm-fs (e.g. none,host).")
@click.option("--prefixes", default="2,6,12,24", show_default=True, help="Working sets: distinct prefixes.")
@click.option("--concurrency", default="4", show_default=True, help="Client concurrencies (--max-concurrency).")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1), help="Interleaved rounds.")
@click.option("--prefix-len", default=4096, show_default=True, type=click.IntRange(1), help="Prefix tokens.")
@click.option("--suffix-len", default=64, show_default=True, type=click.IntRange(1), help="Suffix tokens.")
@click.option("--output-len", default=16, show_default=True, type=click.IntRange(1), help="Output tokens.")
@click.option("--requests-per-prefix", default=8, show_default=True, type=click.IntRange(1),
              help="Requests sharing each prefix.")
@click.option("--gpu-blocks", default=96, show_default=True, type=click.IntRange(1),
              help="vLLM's device cache, in blocks (--num-gpu-blocks-override).")
@click.option("--cpu-bytes", default=512 << 20, show_default=True, type=click.IntRange(1),
              help="cpu_bytes_to_use of the host-only configuration.")
@click.option("--tier-cpu-bytes", default=64 << 20, show_default=True, type=click.IntRange(1),
              help="cpu_bytes_to_use in front of a secondary tier (smaller than the working set, so the "
                   "tier serves it).")
@click.option("--fit-requests", default=0, show_default=True, type=click.IntRange(0),
              help="At least this many requests in each cell of the smallest working set (what offloading costs "
                   "when it is not needed: 128 or more).")
@click.option("--workloads", default="prefix", show_default=True,
              help="prefix (vLLM's `vllm bench serve` prefix repetition), multi-turn (vLLM's multi-turn client: "
                   "`make bench-serve` fetches it), or both: prefix,multi-turn.")
@click.option("--conversations", default="16", show_default=True,
              help="Multi-turn working sets: conversations, all active, cycled through by the clients.")
@click.option("--turns", default=4, show_default=True, type=click.IntRange(1), help="User turns per conversation.")
@click.option("--conversation-prefix-len", default=2048, show_default=True, type=click.IntRange(1),
              help="Tokens of context in each conversation's first turn.")
@click.option("--turn-len", default=128, show_default=True, type=click.IntRange(1),
              help="Tokens of each user turn (each answered with --output-len tokens).")
@click.option("--multi-turn-client", default=None,
              help="Folder of vLLM's multi-turn client (default: $KVTIERS_VLLM_MULTI_TURN or build/vllm-multi-turn).")
@click.option("--variant", "variants", multiple=True, metavar="NAME=CONFIG:JSON",
              help="A named copy of configuration CONFIG with these kv_connector_extra_config keys (retry_wait_ms "
                   "and a \"tier\" object go to its secondary tier entry), measured in the same interleaved run, "
                   "e.g. 'fs-nowait=fs:{\"kvtiers_promotion_wait_ms\": 0, \"retry_wait_ms\": 0}'.")
@click.option("--model", default=None,
              help="A model shape made locally on first use (smollm2-135m: SmolLM2-135M's config, random weights; "
                   "its own defaults for --prefix-len, --gpu-blocks, --cpu-bytes, --tier-cpu-bytes, --prefixes) "
                   "or a model directory (default: the tiny local Llama).")
@click.option("--tier-config", "tier_config", multiple=True, metavar="NAME=JSON",
              help="Extra keys of a tier's secondary_tiers entry, e.g. fs='{\"verify\": true}'.")
@click.option("--serve-arg", "serve_args", multiple=True, help="One more argument for every vllm serve.")
@click.option("--workdir", default=None, help="Keep servers' logs, tiers and results here (default: a temp dir).")
@click.option("--plot", "plot_file", default=None, help="Draw req/s against working set to this file.")
@click.option("--soak", default=None, metavar="DURATION",
              help="Instead of the sweep: one kvtiers vllm serve (arena + fs bounded by --fs-max-bytes) under vLLM's "
                   "client at --rate for DURATION (90, 10m, 1h), sampled every --interval (docs/bench.md).")
@click.option("--interval", default="60s", show_default=True, metavar="DURATION", help="Soak: sampling interval.")
@click.option("--rate", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Soak: requests per second per server (Poisson arrivals; --concurrency's largest caps those in "
                   "flight).")
@click.option("--servers", default=1, show_default=True, type=click.IntRange(1, 2),
              help="Soak: servers on one fs root, sharing its bound.")
@click.option("--soak-prefixes", default=48, show_default=True, type=click.IntRange(1),
              help="Soak: the working set, in prefixes (make it larger than the arena and the bound together).")
@click.option("--fs-max-bytes", default=256 << 20, show_default=True, type=click.IntRange(1),
              help="Soak: max_bytes of the fs tier (the bound, shared by --servers 2).")
@click.option("--long", "long_lengths", default=None, metavar="LENGTHS",
              help="Instead of the sweep: time to first token of prompts with LENGTHS-token prefixes (e.g. "
                   "8192,16384), their prefix from the first of --tiers against recomputed (none), one at a time.")
@click.option("--long-requests", default=16, show_default=True, type=click.IntRange(1),
              help="--long: prompts per prefix length, each with a prefix of its own.")
@click.option("--long-rounds", default=1, show_default=True, type=click.IntRange(1),
              help="--long: times the tier's server sends every prompt again, cycling through them (each time "
                   "from the tier).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--report", "report_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Start nothing: print the table (and --plot) of a report saved with --json.")
def serve(tiers: str, peer: bool, configs: str | None, prefixes: str, concurrency: str, repeats: int,
          prefix_len: int, suffix_len: int, output_len: int, requests_per_prefix: int, gpu_blocks: int,
          cpu_bytes: int, tier_cpu_bytes: int, fit_requests: int, workloads: str, conversations: str, turns: int,
          conversation_prefix_len: int, turn_len: int, multi_turn_client: str | None, variants: tuple[str, ...],
          model: str | None, tier_config: tuple[str, ...],
          serve_args: tuple[str, ...], workdir: str | None, soak: str | None, interval: str, rate: float,
          servers: int, soak_prefixes: int, fs_max_bytes: int, long_lengths: str | None, long_requests: int,
          long_rounds: int, plot_file: str | None, as_json: bool, report_file: str | None) -> None:
    """Offloading on a real `vllm serve` under load, per configuration, with vLLM's own client."""
    from . import serve_report

    if report_file:
        rep = _saved(report_file)
        if rep.get("kind") == "serve-soak":
            _soak_out(rep, plot_file, as_json)
            return
        if rep.get("kind") == "serve-long":
            from . import serve_long

            click.echo(json.dumps(rep) if as_json else serve_long.render(rep))
            return
        if plot_file:
            serve_report.plot(rep, plot_file)
        click.echo(json.dumps(rep) if as_json else serve_report.render(rep))
        return
    if soak is not None:
        _soak_command(soak, interval, rate, servers, soak_prefixes, fs_max_bytes, concurrency, model, prefix_len,
                      suffix_len, output_len, gpu_blocks, tier_cpu_bytes, serve_args, workdir, plot_file, as_json)
        return

    if long_lengths is not None:
        _long_command(long_lengths, long_requests, long_rounds, tiers, repeats, model, suffix_len, output_len,
                      gpu_blocks, tier_cpu_bytes, tier_config, serve_args, workdir, as_json)
        return

    names = configs.split(",") if configs is not None else (
        ["none", "host"] + [t for t in tiers.split(",") if t.strip()] + (["vllm-fs"] if peer else []))
    try:
        vlist = [sv.parse_variant(v) for v in variants]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--variant") from None
    try:
        vnames = {v.name for v in vlist}
        cfgs = sv.with_variants(sr.configs_for(names), vlist)
        for c in cfgs:
            sr.check_tier(c.base if c.name in vnames else c.name)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--configs/--tiers/--variant") from None
    wl = [w.strip() for w in workloads.split(",") if w.strip()]
    bad = [w for w in wl if w not in WORKLOADS]
    if bad or not wl:
        raise click.BadParameter(f"{workloads!r}: the workloads are {', '.join(WORKLOADS)} (comma-separated)",
                                 param_hint="--workloads")
    n_list = _ints(conversations, "--conversations")
    client = None
    if "multi-turn" in wl:
        try:
            client = mtc.client_dir(multi_turn_client)
        except mtc.ClientMissing as e:
            raise click.UsageError(str(e)) from None
    extra = _tier_extra(tier_config)
    from ..tinymodel import SHAPES

    shape = model.lower() if model is not None and model.lower() in SHAPES else None
    if model is not None and shape is None and not os.path.isdir(model):
        raise click.BadParameter(f"{model!r} is neither a model shape ({', '.join(sorted(SHAPES))}) nor a directory",
                                 param_hint="--model")
    ctx = click.get_current_context()
    opts = shape_defaults(shape, {"prefix_len": prefix_len, "gpu_blocks": gpu_blocks, "cpu_bytes": cpu_bytes,
                                  "tier_cpu_bytes": tier_cpu_bytes, "prefixes": prefixes,
                                  "conversation_prefix_len": conversation_prefix_len},
                          lambda k: ctx.get_parameter_source(k) is click.core.ParameterSource.DEFAULT)
    prefix_len, gpu_blocks, cpu_bytes, tier_cpu_bytes, prefixes, conversation_prefix_len = (
        opts["prefix_len"], opts["gpu_blocks"], opts["cpu_bytes"], opts["tier_cpu_bytes"], opts["prefixes"],
        opts["conversation_prefix_len"])
    p_list, c_list = _ints(prefixes, "--prefixes"), _ints(concurrency, "--concurrency")
    if plot_file:
        serve_report.require_plot()
    from ..requires import require

    require("kvtiers bench serve", "vllm")
    model, _ = resolve_model(model)
    settings = sr.ServeSettings(model=model, prefix_len=prefix_len, suffix_len=suffix_len, output_len=output_len,
                                per_prefix=requests_per_prefix, gpu_blocks=gpu_blocks, cpu_bytes=cpu_bytes,
                                tier_cpu_bytes=tier_cpu_bytes,
                                extra_serve_args=list(serve_args))
    if "multi-turn" in wl and min(c_list) > min(n_list):
        raise click.BadParameter(f"--conversations {min(n_list)} is fewer than --concurrency {min(c_list)}: the "
                                 f"multi-turn client needs a conversation per client", param_hint="--conversations")
    mt = mtc.MultiTurnSettings(prefix_len=conversation_prefix_len, turns=turns, turn_len=turn_len,
                               output_len=output_len)
    rep = run_bench_serve(cfgs, settings, p_list, c_list, repeats, workdir=workdir, tier_extra=extra, quiet=as_json,
                          workloads=wl, conversations=n_list, multi_turn=mt, client=client,
                          fit_requests=fit_requests)
    if plot_file:
        serve_report.plot(rep, plot_file)
    click.echo(json.dumps(rep) if as_json else serve_report.render(rep))
    failed = sum(r["failed"] for r in rep["cells"])
    if failed or not rep["identity"]["identical"] or any(r.get("error") for r in rep["runs"]):
        sys.exit(1)
