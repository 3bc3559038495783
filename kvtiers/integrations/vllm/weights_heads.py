"""Which bytes were published under a model's name: the head records of the ``kvtiers`` load format.

:class:`~kvtiers.engine.weights.ModelWeights` keys a model's chunks by the digest of its bytes,
which a forking engine, with no checkpoint to read, cannot compute. So a publishing engine also
writes a head record per rank: a small JSON object (``digest``, ``chunk_bytes``, ``nbytes``,
``layout``) under the identity less its digest (name, revision, rank, world size) in every tier,
and a forking engine reads it to learn the identity it forks.

Tiers keep the first value stored under a key (rule 7), so records are a log, never rewritten:
``head/0``, ``head/1``, ...; a publish whose digest differs from the last record's appends the
next one (the same bytes published again add nothing), and a fork takes the last record it finds
(the first key no tier holds ends the log). Records live in a namespace of their own (4 KiB
chunks), beside the weights' namespace. Only this module reaches into ModelWeights' internals
(its chunk store and load with the manifest buffer as the source).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...engine.weights import ModelWeights, WeightsIdentity
from ...types import PAGE

__all__ = ["HEAD_BYTES", "MAX_HEADS", "Head", "Heads"]

HEAD_BYTES = PAGE
MAX_HEADS = 1024  # records read at most per identity
_KEY = b"head/%d"


@dataclass(frozen=True)
class Head:
    """One head record: the identity of the bytes published (digest included), their size, and
    vLLM's parameter layout they were taken in."""

    identity: WeightsIdentity
    nbytes: int
    layout: str


class Heads:
    """The head log of one model identity (``name``, ``revision``, ``rank``, ``world_size``) in the
    tiers of ``config`` (a kvtiers config mapping). Close it when done (a context manager)."""

    def __init__(self, config: dict[str, Any], *, name: str, revision: str | None, rank: int, world_size: int,
                 timeout: float = 60.0) -> None:
        import torch

        self.name, self.revision, self.rank, self.world_size = name, revision, rank, world_size
        cfg = dict(config, host_bytes=16 * HEAD_BYTES)
        cfg.pop("host_blocks_factor", None)
        self._w = ModelWeights({"head": torch.zeros(HEAD_BYTES, dtype=torch.uint8)}, cfg, name=name,
                               revision=revision, rank=rank, world_size=world_size, chunk_bytes=HEAD_BYTES,
                               timeout=timeout)
        self._w._open_tiers()
        self._slot = self._w.plan.num_chunks  # the copier's id of the first manifest-buffer chunk

    def close(self) -> None:
        self._w.close()

    def __enter__(self) -> Heads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self) -> int:
        """How many records the log holds (the first index no tier holds)."""
        n = 0
        while n < MAX_HEADS and self._w._in_tier(_KEY % n):
            n += 1
        return n

    def _read(self, index: int) -> dict[str, Any]:
        w, key = self._w, _KEY % index
        w.copier.manifest = np.zeros(HEAD_BYTES, dtype=np.uint8)
        try:
            w._load([(self._slot, key)])
            raw = bytes(w.copier.manifest).rstrip(b"\0")
        finally:
            w._drop_host([key], release=True)
            w.copier.manifest = np.zeros(0, dtype=np.uint8)
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError(f"a JSON {type(doc).__name__}")
        except (ValueError, UnicodeDecodeError) as e:
            raise LookupError(f"weights: the head record {index} of {self._where()} is damaged: {e}") from None
        return doc

    def _where(self) -> str:
        rev = f"revision {self.revision!r}" if self.revision is not None else "no revision"
        return f"model {self.name!r} {rev} rank {self.rank}/{self.world_size}"

    def latest(self) -> Head:
        """The last record published; ``LookupError`` naming the identity when no tier has one."""
        n = self._count()
        if not n:
            raise LookupError(f"weights: no tier holds a publish of {self._where()}")
        doc = self._read(n - 1)
        try:
            ident = WeightsIdentity(self.name, self.revision, self.rank, self.world_size, int(doc["chunk_bytes"]),
                                    str(doc["digest"]))
            return Head(ident, int(doc["nbytes"]), str(doc["layout"]))
        except (KeyError, TypeError, ValueError) as e:
            raise LookupError(f"weights: the head record {n - 1} of {self._where()} is damaged: "
                              f"{type(e).__name__} {e}") from None

    def append(self, identity: WeightsIdentity, nbytes: int, layout: str) -> bool:
        """Record that ``identity``'s bytes were published; False when the last record already
        names them. ``RuntimeError`` when no tier stored the record."""
        n = self._count()
        if n:
            try:
                if self._read(n - 1).get("digest") == identity.digest:
                    return False
            except LookupError:
                pass  # a damaged last record: the next one supersedes it
        raw = json.dumps({"kvtiers_weights_head": 1, "digest": identity.digest, "chunk_bytes": identity.chunk_bytes,
                          "nbytes": nbytes, "layout": layout}, sort_keys=True).encode()
        if len(raw) > HEAD_BYTES:
            raise ValueError(f"weights: a head record of {len(raw)} bytes is over {HEAD_BYTES} (layout too long)")
        w, key = self._w, _KEY % n
        w.copier.manifest = np.frombuffer(bytearray(raw.ljust(HEAD_BYTES, b"\0")), dtype=np.uint8)
        try:
            w._store([(self._slot, key)], batch=1)
            w._settle()
        finally:
            w._drop_host([key], release=True)
            w.copier.manifest = np.zeros(0, dtype=np.uint8)
        if not w._in_tier(key):
            raise RuntimeError(f"weights: no tier stored the head record of {identity} "
                               f"(tier errors: {dict(w.manager.stats.tier_errors)})")
        return True
