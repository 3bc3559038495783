"""KV events on the wire: the tiering manager's cache events in vLLM's format.

Routers (llm-d, Dynamo) route requests to the instance most likely to hit its cache by
consuming KV events. This module turns every :class:`~kvtiers.engine.types.CacheEvent`
of a :class:`~kvtiers.engine.manager.TieringManager` (stored in or removed from the host
arena or any tier, third-party tiers included) into vLLM's events and publishes them the
way vLLM 0.33 does (``vllm/distributed/kv_events.py``), so existing consumers decode them
unchanged:

- a ZMQ PUB socket sends three frames per batch: the topic, an 8-byte big-endian sequence
  number starting at 0, and msgpack of the batch ``[ts, [events], data_parallel_rank]``;
- each event is a map tagged under ``"type"`` (``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``); optional fields left at their defaults are omitted, the others
  (``parent_block_hash``, ``lora_id``, ``medium``, ``lora_name``) are always present;
  ``medium`` is ``"GPU"``, ``"CPU"`` (the host arena) or ``"STORAGE"`` (a tier, unless it
  says otherwise), ``locality`` ``"LOCAL"`` or ``"REMOTE"``, and ``ownership`` the tier's
  name;
- an optional ROUTER replay socket answers ``[client_id, b"", start_seq]`` with one message
  ``[client_id, b"", topic, seq, payload]`` per buffered batch from ``start_seq`` on, then
  ``[client_id, b"", b"", seq -1, b""]``;
- ``encoding: "array"`` writes events positionally, ``[tag, field, ...]`` in declaration
  order up to ``lora_name``, the layout of older vLLM versions that older consumers read.

zmq and msgspec are imported when a publisher starts (the ``observe`` extra); building a
config needs neither. No torch here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from ..errors import ConfigError
from .closing import Closing
from .events import HOST
from .types import CacheEvent

__all__ = [
    "LOCAL", "MEDIUM_CPU", "MEDIUM_GPU", "MEDIUM_STORAGE", "REMOTE", "KVEventBridge", "KVEventPublisher",
    "KVEventsConfig", "attach_kv_events", "encode_event", "parse_kv_events",
]

log = logging.getLogger("kvtiers.engine.kvevents")

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
MEDIUMS = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
LOCAL = "LOCAL"
REMOTE = "REMOTE"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """The ``kv_events`` block of a config. The names are vLLM's ``KVEventsConfig``
    (``enable_kv_cache_events`` is accepted for ``enable``), plus ours:

    - ``encoding``: ``"map"`` (vLLM 0.33) or ``"array"`` (positional, older consumers);
    - ``self_describing``: stored events carry the token ids and block hashes a
      :class:`~kvtiers.engine.types.Request` passed (one chunk fans out to its blocks);
      without, a chunk is one block whose hash is the chunk key and no tokens;
    - ``connect``: connect the PUB socket to ``endpoint`` (a central collector) instead of
      binding it (vLLM binds wildcard and ipc/inproc endpoints and connects to others);
    - ``data_parallel_rank``: the batch's rank, as vLLM's;
    - ``described_keys``: how many chunk descriptions to remember for removals;
    - ``linger``: seconds the replay socket keeps answering after close.
    """

    enable: bool = True
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    encoding: str = "map"
    self_describing: bool = False
    connect: bool = False
    data_parallel_rank: int = 0
    described_keys: int = 1 << 20
    linger: float = 0.0


_ALIASES = {"enable_kv_cache_events": "enable"}


def parse_kv_events(obj: Mapping[str, Any] | KVEventsConfig | None) -> KVEventsConfig | None:
    """Check a ``kv_events`` config block; ``None`` when absent or disabled. Raises
    :class:`~kvtiers.ConfigError` naming the key for an unknown key or a wrong type."""
    if obj is None or isinstance(obj, KVEventsConfig):
        return obj if obj is None or obj.enable else None
    if not isinstance(obj, Mapping):
        raise ConfigError(f"config: 'kv_events' expects an object, got {type(obj).__name__}")
    known = {f.name: f for f in fields(KVEventsConfig)}
    values: dict[str, Any] = {}
    for key, value in obj.items():
        if key == "publisher":  # vLLM: "zmq" or "null"
            if value not in ("zmq", "null"):
                raise ConfigError(f"config: kv_events.publisher expects 'zmq' or 'null', got {value!r}")
            if value == "null":
                values["enable"] = False
            continue
        name = _ALIASES.get(key, key)
        if name not in known:
            raise ConfigError(f"config: kv_events: unknown key {key!r} (known: {', '.join(sorted(known))})")
        _check_field(name, value)
        values[name] = value
    cfg = KVEventsConfig(**values)
    return cfg if cfg.enable else None


def _check_field(name: str, value: Any) -> None:
    def want(ok: bool, what: str) -> None:
        if not ok:
            raise ConfigError(f"config: kv_events.{name} expects {what}, got {type(value).__name__} {value!r}")

    is_int = isinstance(value, int) and not isinstance(value, bool)
    if name in ("enable", "self_describing", "connect"):
        want(isinstance(value, bool), "true or false")
    elif name in ("endpoint", "topic"):
        want(isinstance(value, str) and (name == "topic" or "://" in value), "a ZMQ endpoint string"
             if name == "endpoint" else "a string")
    elif name == "replay_endpoint":
        want(value is None or (isinstance(value, str) and "://" in value), "a ZMQ endpoint string or null")
    elif name in ("buffer_steps", "hwm", "max_queue_size", "described_keys"):
        want(is_int and value > 0, "a positive int")
    elif name == "data_parallel_rank":
        want(is_int and value >= 0, "an int >= 0")
    elif name == "encoding":
        want(value in ("map", "array"), "'map' or 'array'")
    elif name == "linger":
        want(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0, "a number >= 0")


# -- events -----------------------------------------------------------------------------

# vLLM 0.33's field order; the first ones have no default and are always written
_STORED_REQUIRED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_STORED_OPTIONAL = ("extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
                    "ownership", "session_id", "lookahead_token_ids")
_REMOVED_REQUIRED = ("block_hashes", "medium")
_REMOVED_OPTIONAL = ("group_idx", "locality", "ownership")
_LAYOUT = {
    "BlockStored": (_STORED_REQUIRED, _STORED_OPTIONAL),
    "BlockRemoved": (_REMOVED_REQUIRED, _REMOVED_OPTIONAL),
    "AllBlocksCleared": ((), ()),
}


def encode_event(kind: str, fields_: Mapping[str, Any], encoding: str = "map") -> Any:
    """One event as the msgpack-ready object of ``encoding``: a map tagged under
    ``"type"`` with ``None`` optional fields left out, or (``"array"``) the positional
    older layout ``[tag, required fields...]``."""
    required, optional = _LAYOUT[kind]
    if encoding == "array":
        return [kind, *(fields_.get(f) for f in required)]
    out: dict[str, Any] = {"type": kind}
    for f in required:
        out[f] = fields_.get(f)
    for f in optional:
        v = fields_.get(f)
        if v is not None:
            out[f] = v
    return out


# -- the publisher ------------------------------------------------------------------------

class KVEventPublisher(Closing):
    """ZMQ PUB (+ ROUTER replay) publisher of event batches, on its own thread.

    :meth:`publish` takes a list of encoded events (:func:`encode_event`), reserves the
    next sequence number and queues the batch without blocking; a batch dropped because
    the queue is full leaves a gap that subscribers see. The thread encodes, sends and
    keeps the last ``buffer_steps`` batches for replay. ``endpoint`` and
    ``replay_endpoint`` are the bound addresses (``tcp://127.0.0.1:0`` picks a port).
    """

    def __init__(self, config: KVEventsConfig) -> None:
        import msgspec
        import zmq

        self.config = config
        self._encoder = msgspec.msgpack.Encoder()
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._lock = threading.Lock()
        self.dropped = 0  # batches not queued (queue full)
        self._failed = 0  # batches the socket refused
        self.published = 0  # batches sent
        self.events = Counter()  # event type -> events published
        self._ctx = zmq.Context()
        self._pub = self._replay = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(config.hwm)
            if config.connect:
                self._pub.connect(config.endpoint)
                self.endpoint = config.endpoint
            else:
                self._pub.bind(config.endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = None
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            self._close_sockets()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtiers-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Any], ts: float | None = None) -> int | None:
        """Queue one batch; returns its sequence number, or ``None`` if it was dropped
        (queue full, or closed)."""
        if self._closed:
            return None
        batch = [time.time() if ts is None else ts, events, self.config.data_parallel_rank]
        with self._lock:
            seq = self._seq
            self._seq += 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped += 1
            log.warning("kvtiers: KV event queue full; batch %d dropped (a gap for subscribers)", seq)
            return None
        for ev in events:
            self.events[ev["type"] if isinstance(ev, dict) else ev[0]] += 1
        return seq

    def wait_sent(self, timeout: float = 5.0) -> bool:
        """Wait until every batch queued so far was sent (or dropped); False on timeout."""
        with self._lock:
            target = self._seq
        deadline = time.monotonic() + timeout
        while self.published + self.dropped + self._failed < target:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self, linger: float | None = None) -> None:
        """Send what is queued, keep answering replay requests for ``linger`` seconds
        (default: the config's), then close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._linger = self.config.linger if linger is None else linger
        self._queue.put(None)
        self._thread.join(timeout=30 + self._linger)

    # -- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._serve_replay(0)
                try:
                    item = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if item is None:
                    break
                seq, batch = item
                try:
                    payload = self._encoder.encode(batch)
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    self._buffer.append((seq, payload))
                    self.published += 1
                except Exception:
                    self._failed += 1
                    log.exception("kvtiers: KV event batch %d not sent", seq)
            deadline = time.monotonic() + self._linger
            while time.monotonic() < deadline:
                self._serve_replay(20)
        finally:
            self._close_sockets()

    def _serve_replay(self, timeout_ms: int) -> None:
        sock = self._replay
        if sock is None:
            if timeout_ms:
                time.sleep(timeout_ms / 1000)
            return
        while sock.poll(timeout_ms):
            frames = sock.recv_multipart()
            timeout_ms = 0
            if len(frames) != 3:
                log.warning("kvtiers: replay request of %d frames ignored (expected 3)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    sock.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            sock.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=1000)  # give queued batches a second to leave
        self._ctx.term()


# -- from cache events to KV events -------------------------------------------------------

@dataclass(frozen=True)
class _Chunk:
    """What self-describing events say about one chunk: its blocks."""

    block_hashes: tuple[Any, ...]
    parent: Any
    token_ids: tuple[int, ...]
    block_size: int


class KVEventBridge:
    """A manager listener that turns cache events into KV events and publishes one batch
    per manager call (at the end of its event flush).

    A manager medium maps to ``(medium, locality)``: ``"host"`` is ``("CPU", "LOCAL")``;
    a tier is what its class says in ``medium`` and ``locality`` attributes, else
    ``("STORAGE", "LOCAL")``. ``tier_class(name)`` finds a tier's class by its name.
    ``tokens_per_chunk`` is the ``block_size`` of events that do not describe blocks.
    """

    def __init__(self, publisher: KVEventPublisher | None, *, encoding: str = "map", self_describing: bool = False,
                 blocks_per_chunk: int = 1, tokens_per_chunk: int | None = None,
                 tier_class: Callable[[str], Any] | None = None, described_keys: int = 1 << 20) -> None:
        self.publisher = publisher
        self.encoding = encoding
        self.self_describing = self_describing
        self.blocks_per_chunk = blocks_per_chunk
        self.tokens_per_chunk = tokens_per_chunk or 0
        self._tier_class = tier_class or (lambda name: None)
        self._mediums: dict[str, tuple[str, str]] = {HOST: (MEDIUM_CPU, LOCAL)}
        self._pending: list[Any] = []
        self._chunks: OrderedDict[bytes, _Chunk] = OrderedDict()
        self._max_chunks = described_keys
        self.blocks: Counter = Counter()  # (event type, medium, ownership) -> block hashes sent

    # -- manager hooks -----------------------------------------------------------------
    def on_store(self, keys: Sequence[bytes], request: Any, first_chunk: int) -> None:
        """Remember the blocks of each chunk of a store call whose request describes them."""
        if not self.self_describing or request is None or not getattr(request, "block_hashes", None):
            return
        hashes = list(request.block_hashes)
        tokens = list(request.token_ids or ())
        bpc = self.blocks_per_chunk
        bs = request.block_size or (self.tokens_per_chunk // bpc if self.tokens_per_chunk else 0)
        for j, key in enumerate(keys):
            b0 = (first_chunk + j) * bpc
            if b0 + bpc > len(hashes):
                break
            parent = hashes[b0 - 1] if b0 > 0 else request.parent_block_hash
            toks = tuple(tokens[b0 * bs:(b0 + bpc) * bs]) if bs and len(tokens) >= (b0 + bpc) * bs else ()
            self._chunks[key] = _Chunk(tuple(hashes[b0:b0 + bpc]), parent, toks, bs)
            self._chunks.move_to_end(key)
        while len(self._chunks) > self._max_chunks:
            self._chunks.popitem(last=False)

    def on_event(self, ev: CacheEvent) -> None:
        """A cache event: encode it (sent at the next :meth:`flush`)."""
        medium, locality = self.medium_of(ev.medium)
        owner = None if ev.medium == HOST else ev.medium
        common = {"medium": medium, "locality": locality, "ownership": owner}
        if ev.kind == "stored":
            for fields_ in self._stored(ev.keys):
                self._add("BlockStored", {**fields_, **common}, medium, owner)
        elif ev.kind == "removed":
            hashes: list[Any] = []
            for key in ev.keys:
                chunk = self._chunks.get(key)
                hashes.extend(chunk.block_hashes if chunk is not None else (key,))
            self._add("BlockRemoved", {"block_hashes": hashes, **common}, medium, owner)

    def cleared(self) -> None:
        """Announce ``AllBlocksCleared`` (e.g. after an engine's cache reset)."""
        self._add("AllBlocksCleared", {}, None, None)
        self.flush()

    def flush(self) -> None:
        """Publish the events encoded since the last flush as one batch."""
        if self._pending and self.publisher is not None:
            self.publisher.publish(self._pending)
        self._pending = []

    # -- internals ------------------------------------------------------------------------
    def medium_of(self, name: str) -> tuple[str, str]:
        """``(medium, locality)`` of a manager medium (``"host"`` or a tier name)."""
        found = self._mediums.get(name)
        if found is None:
            cls = self._tier_class(name)
            medium = getattr(cls, "medium", None)
            locality = getattr(cls, "locality", None)
            found = (medium if medium in MEDIUMS else MEDIUM_STORAGE,
                     locality if locality in (LOCAL, REMOTE) else LOCAL)
            if cls is not None:
                self._mediums[name] = found
        return found

    def _stored(self, keys: Sequence[bytes]) -> list[dict[str, Any]]:
        """BlockStored field sets for ``keys``: runs of described chunks whose blocks chain
        (each chunk's parent is the previous one's last block) become one event; the
        undescribed chunks one event of chunk keys."""
        out: list[dict[str, Any]] = []
        plain: list[bytes] = []
        run: dict[str, Any] | None = None
        for key in keys:
            chunk = self._chunks.get(key) if self.self_describing else None
            if chunk is None:
                plain.append(key)
                continue
            if (run is not None and run["block_size"] == chunk.block_size
                    and run["block_hashes"][-1] == chunk.parent and bool(run["token_ids"]) == bool(chunk.token_ids)):
                run["block_hashes"].extend(chunk.block_hashes)
                run["token_ids"].extend(chunk.token_ids)
                continue
            run = {"block_hashes": list(chunk.block_hashes), "parent_block_hash": chunk.parent,
                   "token_ids": list(chunk.token_ids), "block_size": chunk.block_size}
            out.append(run)
        if plain:
            out.append({"block_hashes": plain, "parent_block_hash": None, "token_ids": [],
                        "block_size": self.tokens_per_chunk})
        return out

    def _add(self, kind: str, fields_: dict[str, Any], medium: str | None, owner: str | None) -> None:
        self._pending.append(encode_event(kind, fields_, self.encoding))
        self.blocks[kind, medium, owner] += len(fields_.get("block_hashes", ()))


def attach_kv_events(mgr: Any, config: Mapping[str, Any] | KVEventsConfig) -> KVEventBridge | None:
    """Publish ``mgr``'s cache events as KV events (``config``: a ``kv_events`` block).
    The publisher closes with the manager. Returns the bridge (its ``publisher`` has the
    bound endpoints and counts), or ``None`` when the block disables publishing."""
    cfg = parse_kv_events(config)
    if cfg is None:
        return None
    publisher = KVEventPublisher(cfg)
    try:
        bridge = KVEventBridge(
            publisher, encoding=cfg.encoding, self_describing=cfg.self_describing,
            blocks_per_chunk=mgr.blocks_per_chunk, tokens_per_chunk=mgr.tokens_per_chunk,
            tier_class=lambda name: next((type(t.handle.tier) for t in mgr.tiers if t.name == name), None),
            described_keys=cfg.described_keys,
        )
    except BaseException:
        publisher.close()
        raise
    events = mgr._events  # the manager's event bus (kvtiers.engine.events)
    events.add_store_observer(bridge.on_store)
    events.add_listener(bridge.on_event)
    events.add_flush_hook(bridge.flush)

    def close() -> None:
        bridge.flush()
        publisher.close()

    events.add_closer(close)
    mgr.kv_events = bridge
    return bridge
