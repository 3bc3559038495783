"""The fs tier's bound: the cleaner's eviction passes and a non-cleaner's share.

:class:`BoundMixin` is part of :class:`kvtiers_fs.tier.FsTier` (kept apart for its size): with
``max_bytes``, the instance holding the cleaner's lease evicts least recently used chunks
down to the bound, numbering its passes for the others (:mod:`kvtiers_fs.share`); every
other bounded instance keeps what it stored that the cleaner has not counted yet within its
share of the bound. See docs/fs.md, Sharing a bounded root.
"""

from __future__ import annotations

import logging
import os

from .keytable import dir_of, fingerprint
from .lease import read_passes, write_passes
from .share import budget_for

log = logging.getLogger("kvtiers.fs")


class BoundMixin:
    """Eviction and pass bookkeeping of :class:`~kvtiers_fs.tier.FsTier` (uses its index,
    walker, lease, share and ``ctx``)."""

    def _check_bound(self) -> None:
        """Not the cleaner: warn (once per cleaner and bound) when the cleaner's ``max_bytes``,
        which governs the directory, is not this instance's (docs/fs.md, Sharing a bounded root)."""
        got = self.lease.holder()
        if got is None:
            return
        who, theirs = got
        if theirs is None or theirs == self.max_bytes or (who, theirs) in self._bound_warned:
            return
        self._bound_warned.add((who, theirs))
        log.warning("fs tier: max_bytes=%d here, but the cleaner of %s (%s) has max_bytes=%d: the cleaner's bound "
                    "governs the directory while it holds the lease (this instance only keeps its own share of "
                    "%d bytes); give every instance on one root the same max_bytes",
                    self.max_bytes, self.nsdir, who, theirs, budget_for(self.max_bytes, self.file_bytes))

    def _evict_to_bound(self) -> None:
        if self.is_cleaner:
            self._make_room()

    def _begin_pass(self) -> int | None:
        """As the lease holder: record that a pass begins (its number), before it lists
        anything (see :mod:`kvtiers_fs.share`). None when this instance is not the cleaner,
        or every bounded instance cleans (no locks)."""
        if not self.is_cleaner or self.lease.unsupported:
            return None
        if self._passes is None:  # (taking over: go on from the last holder's numbers)
            self._passes = read_passes(self.nsdir) or (0, 0)
        begun = self._passes[0] + 1
        self._passes = (begun, self._passes[1])
        self.walker.deferred = 0
        write_passes(self.nsdir, *self._passes)
        return begun

    def _end_pass(self, begun: int | None) -> None:
        """Record that pass ``begun`` has completed: its view counts every chunk published
        before it began and is within ``max_bytes``. A pass that left directories to list
        again, or could not evict down to the bound, completes nothing."""
        if begun is None or self.walker.deferred or self.index.used > self.max_bytes:
            return
        self._passes = (begun, begun)
        write_passes(self.nsdir, begun, begun)

    def _evict_share(self) -> None:
        """Not the cleaner, and over its share of the bound: remove this instance's own
        oldest chunks that the cleaner has not counted yet until it is back within its
        share (see :mod:`kvtiers_fs.share`); chunks being read or written here stay."""
        share, index = self._share, self.index

        def busy(key: bytes) -> bool:
            fp = fingerprint(key)
            return fp in index.reading or key in index.writing or index.pinned(fp)

        gone = []
        for key, n in share.take(share.excess(), skip=busy):
            try:
                os.unlink(self.path(key))
            except FileNotFoundError:
                pass  # removed already (the cleaner, gc): gone all the same
            except OSError as e:
                log.warning("fs tier: could not remove %s: %s", self.path(key), e)
                share.give_back(key, n)
                continue
            index.drop(key)
            gone.append(key)
        if gone:
            self.ctx.removed(gone, "evicted")

    def _make_room(self) -> None:
        """Evict least recently used chunks until the view is within ``max_bytes``. The
        index knows keys by fingerprint: the victims' names come from listing their
        directories (one listing per directory, a cost that grows with the evictions).
        Keys whose fingerprints collide are one entry: their files are kept or deleted
        together, each deletion reported. Never raises: a store that called it still
        finishes and releases its reservation."""
        removed: list[tuple[float, bytes]] = []
        try:
            with self._evicting:
                self._evict(removed)
        except Exception:
            log.exception("fs tier: eviction under %s failed", self.nsdir)
        if removed:
            keys = [k for _, k in sorted(removed)]  # reported least recently used first
            # a store of the same key may have found the old file and re-added it meanwhile
            for k in keys:
                if k in self.index and not os.path.exists(self.path(k)):
                    self.index.drop(k)
            self.ctx.removed(keys, "evicted")

    def _evict(self, removed: list[tuple[float, bytes]]) -> None:
        """:meth:`_make_room`'s passes (under ``_evicting``); adds ``(clock, key)`` to
        ``removed`` for each file deleted."""
        fb = self.file_bytes
        for _ in range(64):
            excess = self.index.excess(self.max_bytes)
            if excess <= 0:
                break
            victims = self.index.victims(-(-excess // fb))
            if not victims:
                break
            by_dir: dict[int, dict[int, float]] = {}
            for fp, clock in victims:
                by_dir.setdefault(dir_of(fp), {})[fp] = clock
            for d, wanted in by_dir.items():
                files: dict[int, list[tuple[bytes, str, float]]] = {}
                for fp, key, path, mtime in self.walker.find_in_dir(d, wanted):
                    files.setdefault(fp, []).append((key, path, mtime))
                for fp, same in files.items():  # (more than one: keys whose fingerprints collide)
                    clock = wanted.pop(fp)
                    newest = max(mtime for _, _, mtime in same)
                    if newest > clock + 0.05:  # used by another instance since: not old after all
                        self.index.refresh(fp, clock, newest)
                        continue
                    if not self.index.evicted(fp, clock, same[0][0]):
                        continue  # used, read or stored here meanwhile
                    for key, _, _ in same[1:]:
                        self.index.drop(key)  # (its entry went with the first: forget the key itself)
                    for key, path, _ in same:
                        try:
                            os.unlink(path)
                        except FileNotFoundError:
                            pass  # another instance removed it first
                        except OSError as e:
                            log.warning("fs tier: could not remove %s: %s", path, e)
                            continue
                        removed.append((clock, key))
                for fp, clock in wanted.items():  # not there any more: removed by someone else
                    self.index.forget(fp, clock)
