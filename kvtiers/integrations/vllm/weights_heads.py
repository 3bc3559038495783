"""Which bytes were published under a model's name: the head records of the ``kvtiers`` load format.

:class:`~kvtiers.engine.weights.ModelWeights` keys a model's chunks by the digest of its bytes,
which a forking engine, with no checkpoint to read, cannot compute. So a publishing engine also
writes a head record per rank: a small JSON object (``digest``, ``chunk_bytes``, ``nbytes``,
``layout``) under the identity less its digest (name, revision, rank, world size) in every tier,
and a forking engine reads the newest whole one to learn the identity it forks.

Tiers have no compare-and-set, and two stores of one key may both report success while only
one copy stays (rule 7). So no two appends store one key with different bytes: each record
lives under a key of its own, ``h/<token>``, the token 20 hex digits: 12 of time (the
publisher's clock in milliseconds, raised above the newest whole record it saw) then 8
random. Readers find the tokens with lookups alone: every prefix of a token is a node key
``t/<prefix>`` whose bytes are the same for every publisher, so concurrent stores of a node
lose nothing. A reader walks this trie of hex digits (16 keys per lookup) from the root; a fork
takes the greatest token whose record is whole (a publish reports a record only once some tier
holds it and all its nodes; a missing or damaged one is skipped, logged), so two publishers
appending at once both keep their records, and the newest by time wins.

Records live in a namespace of their own (4 KiB chunks), beside the weights' namespace. Only
this module reaches into ModelWeights' internals (its chunk store and load with the manifest
buffer as the source).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...engine.closing import Closing
from ...engine.weights import ModelWeights, WeightsIdentity, tier_hits
from ...engine.weights_chunks import json_depth
from ...types import PAGE

__all__ = ["HEAD_BYTES", "MAX_HEADS", "Head", "Heads"]

log = logging.getLogger("kvtiers.weights.heads")

HEAD_BYTES = PAGE
MAX_HEADS = 1024  # records listed at most per identity
TOKEN_DIGITS = 20  # hex digits of a record's token: 12 of time, 8 random
_TIME_DIGITS = 12
MAX_STEPS = 4096  # trie nodes a fork looks into at most (dead ends: appends that never finished)
_HEX = "0123456789abcdef"
_RECORD = b"h/%s"  # a record, under its whole token
_NODE = b"t/%s"  # a prefix of some record's token (the same bytes whoever stores it)
_NODE_BYTES = b"kvtiers weights head node\n"
_MAX_DEPTH = 4  # a record's JSON is one flat object; more nesting is a damaged record
_ASK = 64  # keys per lookup call while walking
_MAX_INT = 1 << 60  # sizes beyond these are damaged, not a reason to allocate
_MAX_CHUNK = 1 << 30


@dataclass(frozen=True)
class Head:
    """One head record: the identity of the bytes published (digest included), their size, and
    vLLM's parameter layout they were taken in."""

    identity: WeightsIdentity
    nbytes: int
    layout: str


class Heads(Closing):
    """The head records of one model identity (``name``, ``revision``, ``rank``, ``world_size``)
    in the tiers of ``config`` (a kvtiers config mapping). Close it when done (a context manager)."""

    def __init__(self, config: dict[str, Any], *, name: str, revision: str | None, rank: int, world_size: int,
                 timeout: float = 60.0) -> None:
        import torch

        self.name, self.revision, self.rank, self.world_size = name, revision, rank, world_size
        cfg = dict(config, host_bytes=(TOKEN_DIGITS + 8) * HEAD_BYTES)  # one append's keys in one store
        cfg.pop("host_blocks_factor", None)
        self._w = ModelWeights({"head": torch.zeros(HEAD_BYTES, dtype=torch.uint8)}, cfg, name=name,
                               revision=revision, rank=rank, world_size=world_size, chunk_bytes=HEAD_BYTES,
                               timeout=timeout)
        self._w._open_tiers()
        self._slot = self._w.plan.num_chunks  # the copier's id of the first manifest-buffer chunk

    def close(self) -> None:
        self._w.close()

    # -- reading ------------------------------------------------------------------------------
    def latest(self) -> Head:
        """The newest whole record (greatest token); damaged or missing records are skipped and
        logged. ``LookupError`` naming the identity when no tier holds a whole one."""
        damaged: list[str] = []
        for token in self._descending(MAX_STEPS):
            try:
                return self.read(token)
            except LookupError as e:
                damaged.append(str(e).removeprefix("weights: "))
                log.warning("%s; skipped", e)
        if damaged:
            raise LookupError(f"weights: no tier holds a whole head record of {self._where()} "
                              f"({len(damaged)} damaged; newest: {damaged[0]})")
        raise LookupError(f"weights: no tier holds a publish of {self._where()}")

    def records(self, limit: int = MAX_HEADS) -> list[str]:
        """The tokens of the records the tiers hold (at most ``limit``, the newest), newest first;
        whole or not (:meth:`read` says)."""
        frontier = [""]
        for _ in range(TOKEN_DIGITS):
            present = self._present([self._child_key(p + c) for p in frontier for c in _HEX])
            frontier = sorted((p + c for p in frontier for c in _HEX if self._child_key(p + c) in present),
                              reverse=True)[:limit]
            if not frontier:
                return []
        return frontier

    def read(self, token: str) -> Head:
        """The record under ``token``; ``LookupError`` when no tier holds it whole or it is damaged
        (not JSON, nested, a field missing or of another type or range)."""
        w, key = self._w, _RECORD % token.encode()
        w.copier.manifest = np.zeros(HEAD_BYTES, dtype=np.uint8)
        try:
            w._load([(self._slot, key)])
            raw = bytes(w.copier.manifest).rstrip(b"\0")
        except (LookupError, TimeoutError) as e:  # a tier's checksum failed, or the record is gone
            why = str(e).rpartition(" is in no tier ")[2] or str(e)
            raise LookupError(f"weights: the head record {token} of {self._where()} is in no tier whole "
                              f"{why}") from None
        finally:
            w._drop_host([key], release=True)
            w.copier.manifest = np.zeros(0, dtype=np.uint8)
        try:
            return self._parse(raw)
        except (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError, OverflowError) as e:
            raise LookupError(f"weights: the head record {token} of {self._where()} is damaged: "
                              f"{type(e).__name__} {e}") from None

    def _parse(self, raw: bytes) -> Head:
        depth = json_depth(raw)
        if depth > _MAX_DEPTH:
            raise ValueError(f"its JSON nests {depth} levels deep")
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError(f"a JSON {type(doc).__name__}, not an object")
        digest, layout = doc["digest"], doc["layout"]
        chunk_bytes, nbytes = _int(doc, "chunk_bytes", 1, _MAX_CHUNK), _int(doc, "nbytes", 0, _MAX_INT)
        if chunk_bytes % PAGE:
            raise ValueError(f"chunk_bytes {chunk_bytes} is not a multiple of {PAGE}")
        if not isinstance(layout, str):
            raise TypeError(f"layout is a {type(layout).__name__}, not a string")
        ident = WeightsIdentity.from_dict({"name": self.name, "revision": self.revision, "rank": self.rank,
                                           "world_size": self.world_size, "chunk_bytes": chunk_bytes,
                                           "digest": digest if isinstance(digest, str) else repr(digest)})
        if not ident.digest:
            raise ValueError("no digest")
        return Head(ident, nbytes, layout)

    # -- writing ------------------------------------------------------------------------------
    def append(self, identity: WeightsIdentity, nbytes: int, layout: str) -> str | None:
        """Record that ``identity``'s bytes were published; returns the new record's token, or
        None when the newest whole record already names these bytes. ``RuntimeError`` when no
        tier stored the whole record. Safe to call from several processes at once: every token
        returned names a record that readers find."""
        newest = None
        for token in self._descending(MAX_STEPS):
            try:
                head = self.read(token)
            except LookupError as e:
                log.warning("%s; skipped", e)
                continue
            if head.identity.digest == identity.digest:
                return None
            newest = token
            break
        raw = json.dumps({"kvtiers_weights_head": 2, "digest": identity.digest, "chunk_bytes": identity.chunk_bytes,
                          "nbytes": nbytes, "layout": layout}, sort_keys=True).encode()
        if len(raw) > HEAD_BYTES:
            raise ValueError(f"weights: a head record of {len(raw)} bytes is over {HEAD_BYTES} (layout too long)")
        token = _new_token(newest)
        self._put(token, raw)
        return token

    def _put(self, token: str, raw: bytes) -> None:
        """Store ``raw`` under ``token`` and every prefix's node, in one store; ``RuntimeError``
        unless some tier then holds them all."""
        w = self._w
        keys = [_RECORD % token.encode()] + [_NODE % token[:i].encode() for i in range(1, TOKEN_DIGITS)]
        buf = bytearray(2 * HEAD_BYTES)
        buf[: len(raw)] = raw
        buf[HEAD_BYTES : HEAD_BYTES + len(_NODE_BYTES)] = _NODE_BYTES
        w.copier.manifest = np.frombuffer(buf, dtype=np.uint8)
        try:
            w._store([(self._slot, keys[0])] + [(self._slot + 1, k) for k in keys[1:]], batch=len(keys))
            w._settle()
        finally:
            w._drop_host(keys, release=True)
            w.copier.manifest = np.zeros(0, dtype=np.uint8)
        if not any(self._tier_holds(t, keys) for t in w.manager.tiers):
            raise RuntimeError(f"weights: no tier stored the whole head record {token} of {self._where()} "
                               f"(tier errors: {dict(w.manager.stats.tier_errors)})")

    # -- the trie -----------------------------------------------------------------------------
    @staticmethod
    def _child_key(prefix: str) -> bytes:
        return (_RECORD if len(prefix) == TOKEN_DIGITS else _NODE) % prefix.encode()

    def _descending(self, max_steps: int):
        """The tokens some tier has a record key for, greatest first (a depth-first walk of the
        trie, greatest digit first); gives up, logged, after ``max_steps`` lookups."""
        stack, steps = [""], 0
        while stack:
            prefix = stack.pop()
            if len(prefix) == TOKEN_DIGITS:
                yield prefix
                continue
            steps += 1
            if steps > max_steps:
                log.warning("weights: the head records of %s: gave up after %d trie lookups (dead ends)",
                            self._where(), max_steps)
                return
            kids = [prefix + c for c in _HEX]
            present = self._present([self._child_key(k) for k in kids])
            stack.extend(k for k in kids if self._child_key(k) in present)

    def _present(self, keys: list[bytes]) -> set[bytes]:
        """The keys some tier answers HIT for (RETRY asked again for up to 5 s), asked
        :data:`_ASK` at a time: a tier that probes its backend for unknown keys (obj) answers
        MISS for those its probe could not reach in time, and a small probe always can."""
        out: set[bytes] = set()
        for tier in self._w.manager.tiers:
            for i in range(0, len(keys), _ASK):
                out |= tier_hits(tier, [k for k in keys[i : i + _ASK] if k not in out])
        return out

    def _tier_holds(self, tier: Any, keys: list[bytes]) -> bool:
        return tier_hits(tier, keys) == set(keys)

    def _where(self) -> str:
        rev = f"revision {self.revision!r}" if self.revision is not None else "no revision"
        return f"model {self.name!r} {rev} rank {self.rank}/{self.world_size}"

    def _count(self) -> int:
        """How many records the tiers hold (up to :data:`MAX_HEADS`)."""
        return len(self.records())


def _int(doc: dict[str, Any], field: str, low: int, high: int) -> int:
    v = doc[field]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{field} is {v!r}, not an integer")
    if not low <= v <= high:
        raise ValueError(f"{field} {v} is out of range")
    return v


def _new_token(newest: str | None) -> str:
    """12 hex digits of time (now in milliseconds, and above ``newest``'s time), then 8 random."""
    t = time.time_ns() // 1_000_000
    if newest is not None:
        t = max(t, min(int(newest[:_TIME_DIGITS], 16) + 1, (1 << 4 * _TIME_DIGITS) - 1))
    return f"{t:0{_TIME_DIGITS}x}{secrets.token_hex((TOKEN_DIGITS - _TIME_DIGITS) // 2)}"
