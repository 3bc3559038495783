"""The engine-facing value types of the tiering manager: per-request limits, lookup and
transfer results, cache events and transfer statistics. :mod:`kvtiers.engine.manager` uses them;
they are also exported from :mod:`kvtiers`."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class Request:
    """Per-request offload limits. ``cancel()`` stops new transfers for the request;
    transfers already running end normally and keep their slots pinned until then.

    For self-describing KV events (docs/observability.md) an engine may also pass the
    request's ``token_ids``, the engine's ``block_hashes`` (one per block of
    ``block_size`` tokens, from the request's first block), and the ``parent_block_hash``
    of its first block; each stored chunk then fans out to its blocks in the events."""

    request_id: str
    num_prompt_tokens: int | None = None
    max_offload_tokens: int | None = None
    cancelled: bool = False
    token_ids: Sequence[int] | None = None
    block_hashes: Sequence[bytes | int] | None = None
    parent_block_hash: bytes | int | None = None
    block_size: int | None = None
    #: keys this request has offered (a load, then the store of what the load failed, is one
    #: offer: kvtiers.engine.stores.StorePath.offered)
    offered: set[bytes] = field(default_factory=set, init=False, repr=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


@dataclass(frozen=True)
class LookupResult:
    """``num_chunks`` leading chunks can be loaded now; ``sources[i]`` says from where
    (``"host"`` or a tier name). ``retry``: the chunk after them is being promoted or a
    tier is still finding out; ask again (the answer may grow)."""

    num_chunks: int
    sources: tuple[str, ...] = ()
    retry: bool = False


@dataclass(frozen=True)
class TransferResult:
    """A finished :meth:`TieringManager.store` or :meth:`~TieringManager.load`.

    For a load, ``failed_keys`` were not written to the device (recompute them and, for
    a prefix, everything after the first). For a store, ``skipped_keys`` were not stored
    (already cached, under ``store_threshold``, over a token limit, or the arena was full
    of pinned slots). ``sources`` maps each loaded key to where it came from.
    """

    transfer_id: int
    kind: str
    keys: tuple[bytes, ...]
    failed_keys: tuple[bytes, ...] = ()
    skipped_keys: tuple[bytes, ...] = ()
    sources: Mapping[bytes, str] = field(default_factory=dict)
    nbytes: int = 0
    seconds: float = 0.0
    request_id: str | None = None
    cancelled: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failed_keys and not self.cancelled


@dataclass(frozen=True)
class CacheEvent:
    """``kind`` is ``"stored"`` or ``"removed"``; ``medium`` is ``"host"`` or a tier name;
    ``reason`` says why (``"evicted"``, ``"promoted"``, ``"failed"``, a tier's own words)."""

    kind: str
    keys: tuple[bytes, ...]
    medium: str
    reason: str | None = None


class PathStats:
    """Bytes moved on one path and the time at least one copy on it was in flight."""

    __slots__ = ("busy_until", "chunks", "nbytes", "seconds")

    def __init__(self) -> None:
        self.nbytes = 0
        self.chunks = 0
        self.seconds = 0.0
        self.busy_until = 0.0

    def add(self, nbytes: int, chunks: int, start: float, end: float) -> None:
        self.nbytes += nbytes
        self.chunks += chunks
        if end <= self.busy_until:
            return
        self.seconds += end - max(start, self.busy_until)
        self.busy_until = end

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class ManagerStats:
    """Counters for operators and the demo."""

    hits: Counter = field(default_factory=Counter)  # source -> chunks loaded ok
    failed_loads: int = 0
    stored_chunks: int = 0
    skipped_stores: int = 0
    host_full: int = 0
    tier_errors: Counter = field(default_factory=Counter)
    events: Counter = field(default_factory=Counter)  # (kind, medium) -> chunk keys in cache events
    paths: dict[str, PathStats] = field(default_factory=lambda: defaultdict(PathStats))
