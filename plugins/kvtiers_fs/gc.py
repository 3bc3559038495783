"""Offline views and clean-up of an fs tier root: what ``kvtiers fs inspect`` and
``kvtiers fs gc`` run. Safe while tiers are using the root: a tier treats a chunk deleted
under it as a miss (and reports it through ``ctx.removed`` when it notices).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from . import layout
from .index import scan


@dataclass
class NamespaceInfo:
    """One namespace directory under a root."""

    digest: str
    path: str
    fields: dict | None  # None: config.json missing or unreadable
    chunks: int = 0
    bytes: int = 0
    oldest: float | None = None  # file mtimes (last store or load)
    newest: float | None = None
    temps: int = 0  # temporary files (stores in flight, or abandoned)
    problem: str | None = None

    def as_dict(self) -> dict:
        return {
            "digest": self.digest,
            "path": self.path,
            "fields": self.fields,
            "chunks": self.chunks,
            "bytes": self.bytes,
            "oldest": self.oldest,
            "newest": self.newest,
            "temps": self.temps,
            "problem": self.problem,
        }


@dataclass
class GcReport:
    """What gc removed (or would remove, with ``dry_run``)."""

    removed: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    freed_bytes: int = 0
    kept_bytes: int = 0
    dry_run: bool = False


def _is_namespace_dir(entry: os.DirEntry) -> bool:
    name = entry.name
    if not entry.is_dir(follow_symlinks=False) or len(name) != 16:
        return False
    try:
        int(name, 16)
    except ValueError:
        return False
    return True


def list_namespaces(root: str) -> list[str]:
    """Namespace directories (16 hex digits) under ``root``, sorted."""
    try:
        return sorted(e.path for e in os.scandir(root) if _is_namespace_dir(e))
    except FileNotFoundError:
        raise ValueError(f"{root}: no such directory") from None


def _read_fields(nsdir: str) -> tuple[dict | None, str | None]:
    try:
        doc = json.loads(layout.read_regular(os.path.join(nsdir, layout.CONFIG_NAME)))
    except FileNotFoundError:
        return None, "config.json missing"
    except (OSError, ValueError) as e:
        return None, f"config.json unreadable: {e}"
    if not isinstance(doc, dict) or doc.get("kvtiers_namespace") != 1:
        return None, "config.json is not a namespace document"
    if doc.get("digest") != os.path.basename(nsdir):
        return doc.get("fields"), f"config.json names digest {doc.get('digest')!r}"
    return doc.get("fields"), None


def _temps(nsdir: str) -> list[tuple[str, float, int]]:
    out = []
    for h1 in os.scandir(nsdir):
        if not h1.is_dir(follow_symlinks=False):
            continue
        for h2 in os.scandir(h1.path):
            if not h2.is_dir(follow_symlinks=False):
                continue
            for e in os.scandir(h2.path):
                if e.name.endswith(layout.TEMP_SUFFIX):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    out.append((e.path, st.st_mtime, st.st_size))
    return out


def inspect_root(root: str) -> list[NamespaceInfo]:
    """Every namespace under ``root`` with its description, chunk count, bytes, and the
    oldest and newest chunk times."""
    out = []
    for nsdir in list_namespaces(root):
        fields, problem = _read_fields(nsdir)
        info = NamespaceInfo(os.path.basename(nsdir), nsdir, fields, problem=problem)
        found, _ = scan(nsdir, stale_after=float("inf"), stopping=lambda: False, clean=False)
        info.chunks = len(found)
        info.bytes = sum(n for _, _, n in found)
        if found:
            info.oldest = min(t for t, _, _ in found)
            info.newest = max(t for t, _, _ in found)
        info.temps = len(_temps(nsdir))
        out.append(info)
    return out


def gc_root(
    root: str,
    *,
    max_bytes: int | None = None,
    namespace: str | None = None,
    drop: bool = False,
    dry_run: bool = False,
    stale_after: float = 3600.0,
    progress: Any = None,
) -> GcReport:
    """Clean ``root``: remove abandoned temporary files; with ``max_bytes``, delete least
    recently used chunks (oldest mtime first, over all namespaces or just ``namespace``)
    until at most ``max_bytes`` remain; with ``namespace`` and ``drop``, remove that whole
    namespace. ``dry_run`` reports without deleting. ``progress``: a
    :class:`kvtiers.commands.progress.Progress`, advanced once per namespace scanned."""
    if drop and not namespace:
        raise ValueError("--drop needs --namespace DIGEST")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    report = GcReport(dry_run=dry_run)
    nsdirs = list_namespaces(root)
    if namespace is not None:
        nsdirs = [d for d in nsdirs if os.path.basename(d) == namespace]
        if not nsdirs:
            raise ValueError(f"{root}: no namespace {namespace!r}")
    if progress is not None:
        progress.total = len(nsdirs)
    if drop:
        for d in nsdirs:
            found, _ = scan(d, stale_after=float("inf"), stopping=lambda: False, clean=False)
            report.freed_bytes += sum(n for _, _, n in found)
            report.removed.append((d, "dropped namespace"))
            if not dry_run:
                shutil.rmtree(d, ignore_errors=True)
            if progress is not None:
                progress.advance(note=os.path.basename(d))
        return report
    now = time.time()
    chunks: list[tuple[float, str, int]] = []
    for d in nsdirs:
        for path, mtime, size in _temps(d):
            try:  # (the lock decides, never the pid in the name: see layout.remove_if_abandoned)
                if dry_run:
                    stale = layout.temp_is_stale(path, mtime, now, stale_after)
                else:
                    stale = layout.remove_if_abandoned(path, now, stale_after)
            except FileNotFoundError:
                continue  # published or removed meanwhile
            if stale:
                report.removed.append((path, "stale temporary file"))
                report.freed_bytes += size
        found, _ = scan(d, stale_after=float("inf"), stopping=lambda: False, clean=False)
        chunks.extend((t, layout.chunk_path(d, k), n) for t, k, n in found)
        if progress is not None:
            progress.advance(note=f"{os.path.basename(d)}: {len(found)} chunks")
    total = sum(n for _, _, n in chunks)
    if max_bytes is not None and total > max_bytes:
        chunks.sort()
        for _mtime, path, n in chunks:
            if total <= max_bytes:
                break
            report.removed.append((path, "over max_bytes"))
            report.freed_bytes += n
            total -= n
            if not dry_run:
                _unlink(path)
    report.kept_bytes = total
    return report


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
