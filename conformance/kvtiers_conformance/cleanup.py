"""Removing what a run stored, unless ``--keep``.

A tier class with ``conformance_cleanup(config)`` (see ``kvtiers.hookspecs.TierClassSpec``)
removes it itself: the suite calls it after each check with that check's options when they
came from ``conformance_config(scratch)`` (before the scratch directory goes), and once at
the end of the run with the options ``--config`` gave. It removes everything stored under
the suite's namespaces, those whose fields hold the key ``kvtiers_conformance``
(:data:`SUITE_FIELD`), and may return one line saying what it could not remove. Without
the hook the suite uses what it can reach, in a location ``--config`` named:

- **files**: every path an option names (``root_dir``, ``path``, ``"kv"``...) is looked at
  before the run; afterwards whatever appeared is removed — inside a directory that existed,
  the new entries; for a named path that did not exist, the path itself and new siblings
  named after it (``kv.sqlite3-wal``). Nothing that existed before is touched.
- **keys**: for a tier built on :class:`kvtiers.AsyncTier` that implements ``delete``, every
  key a check stored is deleted through a fresh instance after the check (S3 objects, rows
  of a database file that existed before).

A tier with none of these (a remote backend behind plain hooks) keeps what the suite stored;
the report says so when the tier claims ``durable`` or ``shared`` (its data outlives an
instance).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Mapping
from typing import Any

from kvtiers import AsyncTier

from .harness import Harness

#: keys deleted per batch (each batch gathers this many ``delete`` coroutines)
BATCH = 32
#: the field every namespace of the suite has (``Harness.namespace``): what a tier's
#: ``conformance_cleanup`` removes
SUITE_FIELD = "kvtiers_conformance"


def _path_options(config: Mapping[str, Any]) -> list[str]:
    return [os.path.abspath(v) for v in config.values() if isinstance(v, str) and v and "\x00" not in v]


#: a named directory holding more entries than this is not cleaned (walking it would be slow)
MAX_TREE = 200_000


def _tree(root: str, limit: int | None = None) -> set[str] | None:
    """Every path under ``root`` (``None`` when there are more than ``limit``)."""
    out = {root}
    for d, dirs, files in os.walk(root):
        out.update(os.path.join(d, n) for n in dirs + files)
        if limit is not None and len(out) > limit:
            return None
    return out


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


class Cleanup:
    """What removes a run's data: the tier class's ``conformance_cleanup`` hook, and a
    snapshot of the paths ``config`` names, taken at construction (before the run).
    ``config`` is ``None`` when each check has options of its own (``conformance_config``)."""

    def __init__(self, config: Mapping[str, Any] | None, tier_class: type | None = None) -> None:
        self.config = None if config is None else dict(config)
        self.hook = getattr(tier_class, "conformance_cleanup", None)
        self.keys_deleted = 0
        self.files_removed = 0
        self.kept: list[str] = []  #: why something may remain
        self.trees: dict[str, set[str]] = {}  # existing dir -> everything under it
        self.parents: dict[str, tuple[str, set[str]]] = {}  # new path -> (its parent, parent's entries)
        for p in _path_options(config or {}):
            if os.path.isdir(p):
                tree = _tree(p, MAX_TREE)
                if tree is None:
                    self.kept.append(f"{p} holds more than {MAX_TREE} entries: not cleaned")
                else:
                    self.trees[p] = tree
            elif not os.path.exists(p):
                parent = os.path.dirname(p)
                if os.path.isdir(parent):
                    self.parents[p] = (parent, set(os.listdir(parent)))

    def _keep(self, why: str) -> None:
        if why not in self.kept:
            self.kept.append(why)

    def run_hook(self, options: Mapping[str, Any]) -> None:
        """Call the tier's ``conformance_cleanup(options)``; what it says remains, or an
        error it raised, goes to :meth:`note` (cleaning up never changes an outcome)."""
        try:
            left = self.hook(dict(options))  # type: ignore[misc]
        except Exception as e:
            self._keep(f"conformance_cleanup raised {type(e).__name__}: {' '.join(str(e).split())[:200]}")
            return
        if left:
            self._keep(" ".join(str(left).split()))

    def after_check(self, h: Harness) -> None:
        """After one check: its options' data through the hook (options of its own), else
        the keys it stored through ``delete`` (options ``--config`` gave)."""
        if self.hook is None:
            if self.config is not None:
                self.delete_keys(h)
        elif self.config is None:
            self.run_hook(h.config)
        h.stored.clear()

    def finish(self) -> None:
        """At the end of the run: new files go; the hook runs on the ``--config`` options."""
        self.remove_files()
        if self.hook is not None and self.config is not None:
            self.run_hook(self.config)

    def delete_keys(self, h: Harness) -> None:
        """Delete every key ``h``'s check stored, through the tier's ``AsyncTier.delete``."""
        if not any(h.stored.values()):
            return
        cls = h.info.cls
        if not (issubclass(cls, AsyncTier) and cls.delete is not AsyncTier.delete):
            if {"durable", "shared"} & set(getattr(cls, "levels", ())) and not (self.trees or self.parents):
                self._keep("the tier has no conformance_cleanup, is no AsyncTier with delete(key) and its "
                           "options name no path")
            return
        for slot_bytes, keys in h.stored.items():
            t = h.open(slot_bytes=slot_bytes, num_slots=1)
            tier = t.tier
            todo = sorted(keys)

            async def gone(batch: list[bytes], tier: AsyncTier = tier) -> int:
                done = await asyncio.gather(*(tier.delete(k) for k in batch), return_exceptions=True)
                return sum(not isinstance(x, BaseException) for x in done)

            try:
                for i in range(0, len(todo), BATCH):
                    self.keys_deleted += tier.run_sync(gone(todo[i:i + BATCH]), timeout=h.limits.finish_s)
            except Exception as e:  # a backend down now must not turn a PASS into a crash
                self._keep(f"deleting stored keys failed: {type(e).__name__}: {e}")
            finally:
                t.close()
                h.instances.remove(t)
        h.stored.clear()

    def remove_files(self) -> None:
        """Remove every path that appeared under or next to the named paths during the run."""
        for root, before in self.trees.items():
            if not os.path.isdir(root):
                continue
            new = sorted((_tree(root) or set()) - before, key=len)
            for p in new:  # shortest first: a new directory goes with everything in it
                if os.path.lexists(p):
                    _remove(p)
                    self.files_removed += 1
        for path, (parent, before) in self.parents.items():
            if not os.path.isdir(parent):
                continue
            name = os.path.basename(path)
            for entry in sorted(set(os.listdir(parent)) - before):
                if entry == name or (entry.startswith(name) and entry[len(name)] in "-."):
                    _remove(os.path.join(parent, entry))
                    self.files_removed += 1

    def note(self) -> str | None:
        """One line for the report when something may remain, else ``None``."""
        if not self.kept:
            return None
        return "kvtiers conformance: what the suite stored may remain (" + "; ".join(self.kept) + ")"
