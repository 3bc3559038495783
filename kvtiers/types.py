"""The types of the tier contract (v1): what engines and tiers exchange.

Everything here is exported from :mod:`kvtiers`. See docs/contract.md for the rules
these types serve.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import json
import mmap
import operator
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    import asyncio

PAGE = 4096
MAX_KEY_LEN = 64


class Lookup(enum.Enum):
    """A tier's answer for one key."""

    HIT = "hit"
    MISS = "miss"
    RETRY = "retry"


_ONLY_BYTES = {bytes}
_plain_bytes = bytes.__getitem__  # bytes' own slicing: a subclass cannot override it


def check_key(key: object) -> bytes:
    """Return ``key`` as plain ``bytes`` if it is a valid chunk key (1-64 bytes), else raise.

    The one place keys enter: ``Job`` and every tier's ``lookup``/``touch`` go through it. A
    plain ``bytes`` comes back as is; a subclass of ``bytes`` (``numpy.bytes_``, or one
    whose ``hex``, ``__eq__`` or ``__hash__`` says something else) comes back as a plain
    copy of its bytes, so every name a tier derives from a key comes from its real bytes.
    """
    if type(key) is not bytes:
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        key = _plain_bytes(key, slice(None))
    n = bytes.__len__(key)
    if not 1 <= n <= MAX_KEY_LEN:
        raise ValueError(f"key must be 1-{MAX_KEY_LEN} bytes long, got {n} bytes")
    return key


def plain_bytes(keys: object) -> bool:
    """Whether ``keys`` is a list or tuple of plain ``bytes`` only (no subclass, whose ``==``
    or hash could say anything): then a key equal to a valid key is that key, which lets a
    tier answer keys it already knows before :func:`check_keys` (one C-level pass)."""
    return type(keys) in (list, tuple) and set(map(type, keys)) == _ONLY_BYTES


def check_keys(keys: Sequence[bytes]) -> tuple[bytes, ...]:
    """Validate a batch of keys (for ``lookup``/``touch``) and return them as a tuple of
    plain ``bytes`` (see :func:`check_key`)."""
    if isinstance(keys, (bytes, str)):
        raise TypeError("keys must be a sequence of bytes, not a single bytes or str")
    keys = tuple(keys)
    # the common case in two C-level passes (a lookup's batch is all plain bytes of one
    # length): about 4x faster than check_key per key, which stays the path for the rest
    if plain_bytes(keys):
        lengths = set(map(len, keys))
        if min(lengths) >= 1 and max(lengths) <= MAX_KEY_LEN:
            return keys
    return tuple(map(check_key, keys))


PREFIX_KEY_DOMAIN = b"kvtiers-prefix-v1\0"  # the seed of every chain of prefix keys


def prefix_chunk_keys(token_ids: Any, tokens_per_chunk: int, *, salt: bytes = b"") -> list[bytes]:
    """One chunk key per *full* chunk of ``token_ids``: chained SHA-256 hashes, 32 bytes each.

    ``h[-1] = sha256(b"kvtiers-prefix-v1\\0" + salt)``; ``h[i] = sha256(h[i-1] + tokens of
    chunk i)``, the tokens encoded as unsigned 32-bit little-endian integers; key ``i`` is
    ``h[i]`` (its 32-byte digest). So key ``i`` names the whole prefix ``token_ids[:(i + 1) *
    tokens_per_chunk]``: two prompts share key ``i`` exactly when they share that prefix (and
    the salt). A trailing partial chunk gets no key. ``salt``: anything else the KV bytes
    depend on that the namespace does not say (a LoRA adapter, a multimodal input's hash);
    ``b""`` for none.

    ``token_ids``: a flat sequence of ints (a list, a 1-D numpy array or torch tensor).
    Errors are :class:`ValueError` / :class:`TypeError` naming what was wrong.
    """
    import numpy as np

    tpc = operator.index(tokens_per_chunk)
    if tpc <= 0:
        raise ValueError(f"prefix_chunk_keys: tokens_per_chunk must be positive, got {tpc}")
    if not isinstance(salt, (bytes, bytearray, memoryview)):
        raise TypeError(f"prefix_chunk_keys: salt must be bytes, got {type(salt).__name__}")
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise TypeError(f"prefix_chunk_keys: token_ids must be a sequence of ints, not {type(token_ids).__name__}")
    if hasattr(token_ids, "detach"):  # a torch tensor, on any device
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"prefix_chunk_keys: token_ids must be flat (1-D), got shape {tuple(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"prefix_chunk_keys: token_ids must be ints, got {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError("prefix_chunk_keys: token ids must be in 0 .. 2**32 - 1")
    n = len(arr) // tpc
    data = arr[: n * tpc].astype("<u4").tobytes()
    step = 4 * tpc
    h = hashlib.sha256(PREFIX_KEY_DOMAIN + bytes(salt)).digest()
    keys = []
    for i in range(n):
        h = hashlib.sha256(h + data[i * step : (i + 1) * step]).digest()
        keys.append(h)
    return keys


@dataclass(frozen=True)
class Job:
    """A store or load of ``keys[i]`` from/into arena slot ``slots[i]``.

    Keys are distinct bytes of 1-64 bytes, slots are distinct integers (anything
    ``operator.index`` accepts, e.g. numpy int32, is normalised to ``int``), and there are
    as many of each. An empty job is valid. Whether a slot is in range depends on the
    arena; tiers check that with :meth:`Arena.check_job`.
    """

    job_id: int
    keys: tuple[bytes, ...]
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        try:
            job_id = operator.index(self.job_id)
        except TypeError:
            raise TypeError(f"job_id must be an integer, got {type(self.job_id).__name__}") from None
        keys = check_keys(self.keys)
        if isinstance(self.slots, (bytes, str)):
            raise TypeError("slots must be a sequence of integers")
        slots = []
        for s in self.slots:
            try:
                slots.append(operator.index(s))
            except TypeError:
                raise TypeError(f"slot must be an integer, got {type(s).__name__}") from None
        if len(keys) != len(slots):
            raise ValueError(f"job {job_id}: {len(keys)} keys but {len(slots)} slots")
        if len(set(keys)) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise ValueError(f"job {job_id}: duplicate key {dup!r}")
        if len(set(slots)) != len(slots):
            dup = next(s for s in slots if slots.count(s) > 1)
            raise ValueError(f"job {job_id}: duplicate slot {dup}")
        object.__setattr__(self, "job_id", job_id)
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "slots", tuple(slots))


@dataclass(frozen=True)
class JobResult:
    """The outcome of one job, reported once by ``get_finished_jobs``.

    ``failed_keys`` lists the keys that were not stored/loaded; a whole-job failure lists
    every key and says why in ``error``. ``nbytes`` is the bytes actually moved and
    ``seconds`` the time from submit to completion.
    """

    job_id: int
    failed_keys: tuple[bytes, ...] = ()
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "failed_keys", tuple(self.failed_keys))

    @property
    def ok(self) -> bool:
        """True when no key failed."""
        return not self.failed_keys


class Arena:
    """The host arena as tiers see it: ``len(arena)`` slots of ``slot_bytes`` bytes.

    ``arena[i]`` is a writable 1-D ``memoryview`` of slot ``i`` (zero-copy) and
    ``arena.buffer`` the flat view of the whole region. ``slot_bytes`` is a multiple of
    4096 and, for arenas this package allocates, the region is page-aligned so O_DIRECT
    works on slots.
    """

    __slots__ = ("_buf", "_n", "_owner", "slot_bytes")

    def __init__(self, buffer: Any, slot_bytes: int, *, owner: Any = None) -> None:
        slot_bytes = operator.index(slot_bytes)
        if slot_bytes <= 0 or slot_bytes % PAGE:
            raise ValueError(f"slot_bytes must be a positive multiple of {PAGE}, got {slot_bytes}")
        mv = memoryview(buffer)
        if mv.readonly:
            raise ValueError("arena buffer must be writable")
        mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        if len(mv) < slot_bytes:
            raise ValueError(f"arena buffer of {len(mv)} bytes holds no slot of {slot_bytes} bytes")
        self._n = len(mv) // slot_bytes
        self._buf = mv[: self._n * slot_bytes]
        self.slot_bytes = slot_bytes
        self._owner = owner  # keeps the backing object (mmap, tensor, shm) alive

    @classmethod
    def allocate(cls, num_slots: int, slot_bytes: int) -> Arena:
        """A page-aligned, pre-faulted anonymous arena of ``num_slots`` slots."""
        num_slots = operator.index(num_slots)
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        if slot_bytes <= 0 or slot_bytes % PAGE:
            raise ValueError(f"slot_bytes must be a positive multiple of {PAGE}, got {slot_bytes}")
        m = mmap.mmap(-1, num_slots * slot_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mv = memoryview(m)
        for off in range(0, len(mv), PAGE):  # pre-fault: first touches are slow later
            mv[off] = 0
        return cls(mv, slot_bytes, owner=m)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, slot: int) -> memoryview:
        i = operator.index(slot)
        if not 0 <= i < self._n:
            raise IndexError(f"slot {i} out of range: arena has {self._n} slots")
        off = i * self.slot_bytes
        return self._buf[off : off + self.slot_bytes]

    @property
    def buffer(self) -> memoryview:
        """The flat writable view of the whole region."""
        return self._buf

    def check_job(self, job: Job) -> None:
        """Raise ``IndexError`` naming the first slot of ``job`` outside this arena."""
        for s in job.slots:
            if not 0 <= s < self._n:
                raise IndexError(f"job {job.job_id}: slot {s} out of range: arena has {self._n} slots")

    def __repr__(self) -> str:
        return f"Arena({self._n} slots x {self.slot_bytes} bytes)"


def buffer_address(buf: memoryview) -> int:
    """The address of the first byte of a writable, contiguous buffer (the ctypes view is
    dropped at once, so no export of ``buf`` is left behind)."""
    view = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def canonical_json(obj: Any) -> bytes:
    """JSON with sorted keys and no spaces, UTF-8: the form digests are taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Namespace:
    """Everything that changes a chunk's bytes (model, dtype, layout, chunk size, ...).

    ``digest`` is the first 16 hex digits of sha256 over the canonical JSON of
    ``fields``. Persistent tiers keep data under the digest and record
    :meth:`document` as ``config.json``.
    """

    fields: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.fields, dict):
            raise TypeError(f"namespace fields must be a dict, got {type(self.fields).__name__}")
        try:
            canonical_json(self.fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"namespace fields must be JSON-serialisable: {e}") from None

    @property
    def digest(self) -> str:
        return hashlib.sha256(canonical_json(self.fields)).hexdigest()[:16]

    def document(self) -> dict:
        """The ``config.json`` document persistent tiers write once per namespace."""
        return {"kvtiers_namespace": 1, "digest": self.digest, "fields": self.fields}

    def document_bytes(self) -> bytes:
        return json.dumps(self.document(), sort_keys=True, indent=1).encode() + b"\n"

    def check_document(self, raw: bytes | str | dict, where: str = "config.json") -> None:
        """Raise ``ValueError`` if a stored namespace document does not describe this one."""
        try:
            doc = raw if isinstance(raw, dict) else json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{where}: not a namespace document ({e})") from None
        if not isinstance(doc, dict) or doc.get("kvtiers_namespace") != 1:
            raise ValueError(f"{where}: not a kvtiers namespace document")
        if doc.get("digest") != self.digest or canonical_json(doc.get("fields")) != canonical_json(self.fields):
            raise ValueError(
                f"{where}: namespace {self.digest} holds a different description "
                f"(stored digest {doc.get('digest')!r}, fields {doc.get('fields')!r}; "
                f"expected {self.fields!r})"
            )


# -- the chunk trailer: 40 bytes after a chunk's payload, for tiers that keep whole objects --
CHUNK_TRAILER_MAGIC = b"KVTOBJ02"
CHUNK_TRAILER = struct.Struct("<8sQQQ8s")  # magic, payload length, payload xxh3_64, key xxh3_64, namespace
CHUNK_TRAILER_BYTES = CHUNK_TRAILER.size  # 40


class CorruptChunk(ValueError):
    """A stored chunk that is short, long, or fails its trailer checks."""


def namespace_bytes(digest: str) -> bytes:
    """The 8 trailer bytes of a namespace digest (16 hex digits)."""
    raw = bytes.fromhex(digest)
    if len(raw) != 8:
        raise ValueError(f"namespace digest {digest!r} is not 16 hex digits")
    return raw


def make_chunk_trailer(key: bytes, payload: memoryview | bytes, digest: str) -> bytes:
    """The 40-byte trailer (``KVTOBJ02``) for ``payload`` stored under ``key`` in namespace
    ``digest``: magic, payload length (u64), ``xxh3_64(payload)``, ``xxh3_64(key)`` and the
    namespace digest's 8 bytes, little-endian. Written after the payload, so a load streams
    the payload straight into its slot and checks the trailer last."""
    return CHUNK_TRAILER.pack(CHUNK_TRAILER_MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload),
                              xxhash.xxh3_64_intdigest(key), namespace_bytes(digest))


def check_chunk_trailer(key: bytes, payload: memoryview | bytes, trailer: bytes | bytearray | memoryview,
                        digest: str) -> None:
    """Raise :class:`CorruptChunk` unless ``trailer`` vouches for ``payload`` under ``key``
    in namespace ``digest``."""
    if len(trailer) != CHUNK_TRAILER_BYTES:
        raise CorruptChunk(f"trailer is {len(trailer)} bytes, expected {CHUNK_TRAILER_BYTES}")
    magic, length, payload_digest, key_digest, ns = CHUNK_TRAILER.unpack(trailer)
    if magic != CHUNK_TRAILER_MAGIC:
        raise CorruptChunk(f"bad magic {magic!r}")
    if length != len(payload):
        raise CorruptChunk(f"trailer says {length} payload bytes, object holds {len(payload)}")
    if ns != namespace_bytes(digest):
        raise CorruptChunk(f"trailer belongs to namespace {ns.hex()}, not {digest}")
    if key_digest != xxhash.xxh3_64_intdigest(key):
        raise CorruptChunk("trailer belongs to another key")
    if payload_digest != xxhash.xxh3_64_intdigest(payload):
        raise CorruptChunk("payload checksum mismatch")


def chunk_trailer_length(key: bytes, tail: bytes | bytearray | memoryview, digest: str) -> int | None:
    """The payload length a valid trailer of ``key`` in namespace ``digest`` declares, if
    ``tail`` (an object's last :data:`CHUNK_TRAILER_BYTES` bytes) is one; else ``None``
    (a chunk of another size on the same namespace has a valid tail of another length)."""
    if len(tail) != CHUNK_TRAILER_BYTES:
        return None
    magic, length, _, key_digest, ns = CHUNK_TRAILER.unpack(tail)
    if magic != CHUNK_TRAILER_MAGIC or ns != namespace_bytes(digest) or key_digest != xxhash.xxh3_64_intdigest(key):
        return None
    return length


def accept_job(job: object, arena: Arena, *, closed: bool = False) -> Job:
    """The caller-error checks of a submit (rule 8): ``job`` is a :class:`Job`, the tier is
    not ``closed``, and every slot is inside ``arena``. Raises ``TypeError``, ``ValueError``
    or ``IndexError`` naming the fault; returns ``job``."""
    if not isinstance(job, Job):
        raise TypeError(f"expected a kvtiers.Job, got {type(job).__name__}")
    if closed:
        raise ValueError(f"job {job.job_id}: tier is closed")
    arena.check_job(job)
    return job


#: seconds of work a wrapper tier's hook call (a submit, a poll) does on the caller's thread
#: before it returns (rule 5); the next call goes on where it stopped
POLL_BUDGET_S = 0.05


def drain(results: deque) -> list:
    """Pop everything from a deque of results, oldest first (for ``get_finished_jobs``);
    safe against appends from other threads while it runs."""
    out = []
    pop = results.popleft
    while results:
        out.append(pop())
    return out


RemovedSink = Callable[[Sequence[bytes], str], None]


class TierContext:
    """What a tier gets from the SDK: the arena, the namespace, the I/O loop and a sink
    for removals it makes on its own (eviction, gc, corruption)."""

    def __init__(
        self,
        arena: Arena,
        namespace: Namespace | None = None,
        removed: RemovedSink | None = None,
    ) -> None:
        if not isinstance(arena, Arena):
            raise TypeError(f"arena must be a kvtiers.Arena, got {type(arena).__name__}")
        self.arena = arena
        self.namespace = namespace if namespace is not None else Namespace({})
        self._listeners: list[RemovedSink] = [removed] if removed is not None else []
        self._lock = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The process-wide asyncio loop running in the SDK's I/O thread."""
        from .ioloop import get_loop

        return get_loop()

    def add_removed_listener(self, fn: RemovedSink) -> None:
        with self._lock:
            self._listeners.append(fn)

    def removed(self, keys: Iterable[bytes], reason: str) -> None:
        """Report keys the tier dropped on its own; safe to call from any thread."""
        keys = tuple(keys)
        if not keys:
            return
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            fn(keys, reason)


@dataclass
class Baseline:
    """What a tier's optional ``bench_baseline`` classmethod returns: plain I/O on the tier's
    medium, for ``kvtiers bench tier`` to compare the tier with.

    ``put(key, data)`` keeps the bytes of the memoryview ``data`` under ``key``; ``get(key,
    out)`` writes them back into ``out`` (both may be coroutine functions; those run on the
    SDK's I/O loop). ``concurrency``: how many calls the tier itself would have in flight
    (its threads or connection limit); ``load_concurrency`` if loads differ. ``close(keys)``,
    called once at the end with every key the baseline's own ``put`` was given, removes
    what the baseline wrote (the tier's keys go through an :class:`~kvtiers.AsyncTier`'s
    ``delete``); a plain function runs on the bench's thread, a coroutine function on the
    I/O loop. ``name`` says what the baseline is.
    """

    name: str
    put: Callable[[bytes, memoryview], Any]
    get: Callable[[bytes, memoryview], Any]
    concurrency: int = 8
    load_concurrency: int | None = None
    close: Callable[[Sequence[bytes]], None] | None = None
