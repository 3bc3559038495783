"""``kvtiers digest-cache list | drop``: the weight-digest cache of vLLM's model identity.

The cache (:mod:`kvtiers.integrations.weight_digests`) remembers each weight file's digest under
its device, inode, size, mtime and ctime. A write through a shared mapping can leave all five
as they were, and the old digest would be served for good: ``drop PATH`` forgets what is
remembered for a weight file (or every file of a model directory), so the next engine start
reads it again. Imports neither vLLM nor torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from ..integrations.weight_digests import DigestCache, stamp

__all__ = ["digest_cache"]


@click.group(name="digest-cache")
def digest_cache() -> None:
    """The weight-digest cache of vLLM's model identity (docs/vllm.md#namespace): list, drop entries."""


def _state(path: str, key: str) -> str:
    """``current`` (the file at ``path`` still has stamp ``key``), ``changed`` or ``missing``."""
    try:
        return "current" if stamp(os.stat(path)) == key else "changed"
    except OSError:
        return "missing"


@digest_cache.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per entry.")
def list_entries(as_json: bool) -> None:
    """One line per remembered digest: digest, size, state (current, changed, missing), path."""
    cache = DigestCache()
    for key, (digest, path) in cache.entries.items():
        size = int(key.split(":")[2])
        state = _state(path, key)
        if as_json:
            click.echo(json.dumps({"path": path, "size": size, "digest": digest, "state": state}))
        else:
            click.echo(f"{digest}\t{size}\t{state}\t{path}")


def _targets(path: Path) -> tuple[set[str], set[str]]:
    """The stamps of the files ``path`` names now (itself, or each file directly in a directory)
    and the paths the cache may have recorded them under."""
    files = [path] if not path.is_dir() else [q for q in path.iterdir() if q.is_file()]
    stamps, names = set(), set()
    for f in files:
        names.update({str(Path(os.path.realpath(f.parent)) / f.name), os.path.realpath(f), os.path.abspath(f)})
        try:
            stamps.add(stamp(os.stat(f)))
        except OSError:
            pass
    return stamps, names


@digest_cache.command(name="drop")
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("--all", "everything", is_flag=True, help="Forget every remembered digest.")
def drop(paths: tuple[Path, ...], everything: bool) -> None:
    """Forget the remembered digests of PATHS (weight files or model directories), so the next
    engine start reads those files again."""
    if not paths and not everything:
        raise click.UsageError("give the weight files or model directories to forget (PATH ...), or --all")
    cache = DigestCache()
    if everything:
        n = cache.drop(stamps=set(cache.entries))
        dropped = [f"dropped all {n} remembered digest(s)"]
    else:
        dropped = []
        for p in paths:
            n = cache.drop(*_targets(p.expanduser()))
            dropped.append(f"dropped {n} remembered digest(s) of {p}")
    why = cache.save()
    if why is not None:
        raise click.ClickException(f"the weight digest cache {cache.path}: {why}; nothing dropped")
    for line in dropped:
        click.echo(line)
