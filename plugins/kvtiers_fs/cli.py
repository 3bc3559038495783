"""``kvtiers fs inspect|gc`` and ``kvtiers bench fs``, added through ``register_commands``."""

from __future__ import annotations

import datetime
import json

import click

from kvtiers.commands.bench.tier import Size
from kvtiers.config import parse_size

__all__ = ["Size", "parse_size"]


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@click.group(name="fs")
def fs() -> None:
    """Inspect and clean the directories of the fs tier."""


@fs.command()
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def inspect(root: str, as_json: bool) -> None:
    """List the namespaces under ROOT: description, chunks, bytes, oldest and newest."""
    from .gc import inspect_root

    try:
        infos = inspect_root(root)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({"root": root, "namespaces": [i.as_dict() for i in infos]}, indent=1))
        return
    if not infos:
        click.echo(f"{root}: no namespaces")
    for i in infos:
        click.echo(f"namespace {i.digest}")
        click.echo(f"  fields:  {json.dumps(i.fields, sort_keys=True) if i.fields is not None else '-'}")
        click.echo(f"  chunks:  {i.chunks}")
        click.echo(f"  bytes:   {i.bytes} ({_human(i.bytes)})")
        click.echo(f"  oldest:  {_when(i.oldest)}")
        click.echo(f"  newest:  {_when(i.newest)}")
        if i.temps:
            click.echo(f"  temporary files: {i.temps}")
        if i.problem:
            click.echo(f"  problem: {i.problem}")


@fs.command()
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--max-bytes", type=Size(), default=None, help="Delete least recently used chunks down to this size.")
@click.option("--namespace", default=None, metavar="DIGEST", help="Only this namespace.")
@click.option("--drop", is_flag=True, help="With --namespace: remove the whole namespace.")
@click.option("--dry-run", is_flag=True, help="Print what would be removed, remove nothing.")
@click.option("--stale-after", type=float, default=3600.0, show_default=True,
              help="Seconds after which a temporary file of a writer on another host is abandoned.")
@click.option("-q", "--quiet", is_flag=True, help="Only the summary line.")
def gc(root: str, max_bytes: int | None, namespace: str | None, drop: bool, dry_run: bool,
       stale_after: float, quiet: bool) -> None:
    """Remove abandoned temporary files under ROOT, and chunks over --max-bytes (least
    recently used first), or a whole namespace with --namespace D --drop."""
    from kvtiers.commands.progress import bar_only

    from .gc import gc_root

    bar = bar_only(None, "fs gc")  # namespaces scanned, on a terminal; the lines below are the output
    try:
        report = gc_root(root, max_bytes=max_bytes, namespace=namespace, drop=drop, dry_run=dry_run,
                         stale_after=stale_after, progress=bar)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    finally:
        bar.clear()
    verb = "would remove" if dry_run else "removed"
    if not quiet:
        for path, why in report.removed:
            click.echo(f"{verb} {path} ({why})")
    click.echo(f"{verb} {len(report.removed)} item(s), {report.freed_bytes} bytes; "
               f"{report.kept_bytes} bytes of chunks kept")


# `kvtiers bench fs`: the one tier-bench harness with the tier fixed (kvtiers.commands.bench.harness)
from .bench import bench_fs  # noqa: E402, F401
from .churn import churn as _churn  # noqa: E402  (`kvtiers fs churn`: the store rate under eviction)

fs.add_command(_churn)
