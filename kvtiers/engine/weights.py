"""Model weights through the tiers: put a model to sleep, wake it, fork another instance from it.

A model's tensors are bytes with a layout, like KV blocks. :class:`ModelWeights` cuts a model's
storages into chunks of the arena's slot size (:mod:`.weights_chunks`) and moves them with a
:class:`~kvtiers.engine.manager.TieringManager` of its own, built from the usual JSON config:
the same host arena, host cache, store cascade, promotions from the first tier that has a chunk,
load waves and tier fault handling as KV chunks, with a copier between the model's storages and
the slots as its DMA engine. Every tier the config names works, first-party or third-party, and
checksums chunks as it does for KV.

- ``sleep(1)``: every storage into the host arena, then the device memory is freed;
- ``sleep(2)``: into the arena and on to every tier (the arena may be smaller than the model:
  chunks stream through it), then the device memory is freed, and with an elastic arena
  (``"elastic": true``) the arena's pages too;
- ``wake()``: the bytes back into the model's own tensors (the same tensor objects, so an
  engine's references stay valid), from the arena or the first tier that has them, several
  loads in flight so tier reads overlap the copies;
- ``publish()`` / :meth:`ModelWeights.fork`: another process fills its model from the tiers
  instead of parsing the checkpoint.

Memory is freed by resizing each storage to zero bytes (:mod:`.weights_memory`; a storage that
cannot be resized, such as one mapped from a safetensors file, is first swapped for a fresh one
under every tensor that uses it); on CPU the freed memory goes back to the system
(``malloc_trim``) and a wake gives large storages huge-page mappings of their own, on an
accelerator the allocator's cache is emptied.

One namespace per model identity (:class:`WeightsIdentity`: name, revision, parallel rank, chunk
size); inside it, every chunk and the manifest are keyed by the xxh3-128 digest of the model's
bytes, taken afresh at every publish, so weights changed in place (an RL step) are stored under
new keys and never answered by an older copy a tier kept (stores of an existing key keep it:
rule 7), while unchanged weights are not stored again. A wake or fork checks the digest of the
bytes it filled in before returning. Dtypes, shapes and strides are checked tensor by tensor
against the manifest stored with the chunks, so a mismatch names the tensor.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from ..types import PAGE, Lookup, Namespace
from .closing import ClosesManager
from .weights_chunks import WeightCopier, WeightPlan, manifest_bytes, manifest_length, parse_manifest, uint8_view
from .weights_memory import advise_huge, free_storages, give_back_memory, restore_storages, rss_bytes

__all__ = ["DEFAULT_CHUNK_BYTES", "ModelWeights", "WeightsIdentity", "WeightsStep", "rss_bytes"]

DEFAULT_CHUNK_BYTES = 4 << 20
_MANIFEST_KEY = b"%s/manifest/%d"  # digest of the bytes, manifest chunk
_CHUNK_KEY = b"%s/weights/%d"  # digest of the bytes, data chunk
_HOST_KEY = b"host/%d"  # a level-1 sleep: arena only, never sent to a tier


@dataclass(frozen=True)
class WeightsIdentity:
    """What names a model's weights in the tiers: ``name``, ``revision`` (a checkpoint revision,
    or None), the parallel ``rank`` of ``world_size``, the ``chunk_bytes`` they were cut into, and
    ``digest``, the xxh3-128 digest (32 hex digits) of the bytes that were published. A forking
    process needs exactly this: the digest pins the bytes, so weights changed and published again
    under the same revision get a new identity, and an older identity still names its own bytes
    for as long as a tier keeps them."""

    name: str
    revision: str | None = None
    rank: int = 0
    world_size: int = 1
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    digest: str = ""

    def namespace(self) -> Namespace:
        """The namespace the chunks live in (the digest is in each chunk's key, not here)."""
        return Namespace({"kvtiers_weights": 2, "model": self.name, "revision": self.revision, "rank": self.rank,
                          "world_size": self.world_size, "chunk_bytes": self.chunk_bytes})

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "revision": self.revision, "rank": self.rank, "world_size": self.world_size,
                "chunk_bytes": self.chunk_bytes, "digest": self.digest}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WeightsIdentity:
        """From :meth:`to_dict`'s shape; an unknown or missing key is a ``ValueError`` naming it."""
        known = {"name", "revision", "rank", "world_size", "chunk_bytes", "digest"}
        extra = sorted(set(d) - known)
        if extra:
            raise ValueError(f"weights identity: unknown key {extra[0]!r} (known: {', '.join(sorted(known))})")
        if not isinstance(d.get("name"), str) or not d.get("name"):
            raise ValueError(f"weights identity: 'name' must be a non-empty string, got {d.get('name')!r}")
        rev = d.get("revision")
        if rev is not None and (not isinstance(rev, str) or not rev):
            raise ValueError(f"weights identity: 'revision' must be a non-empty string or None, got {rev!r}")
        digest = d.get("digest", "")
        if not isinstance(digest, str) or (digest and not _is_digest(digest)):
            raise ValueError(f"weights identity: 'digest' must be 32 hex digits, got {digest!r}")
        return cls(**dict(d))

    def __str__(self) -> str:
        rev = f"revision {self.revision!r}" if self.revision is not None else "no revision"
        digest = f" digest {self.digest[:12]}" if self.digest else ""
        return f"model {self.name!r} {rev}{digest} rank {self.rank}/{self.world_size}"


def _is_digest(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True)
class WeightsStep:
    """What one step moved: ``action`` (``"sleep"``, ``"wake"``, ``"publish"``, ``"fork"``),
    ``nbytes`` in ``seconds``, chunks per ``sources`` (``"host"`` or a tier name), and the
    process's RSS before and after."""

    action: str
    nbytes: int
    seconds: float
    sources: dict[str, int] = field(default_factory=dict)
    rss_before: int = 0
    rss_after: int = 0

    @property
    def gbps(self) -> float:
        """GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0



def tier_hits(tier: Any, keys: list[bytes], wait_s: float = 5.0) -> set[bytes]:
    """The keys of ``keys`` that ``tier`` (a manager's tier) answers HIT for, those answered
    RETRY asked again for up to ``wait_s``; a tier whose lookup raises holds nothing more."""
    hits: set[bytes] = set()
    ask, deadline = list(keys), time.monotonic() + wait_s
    while ask:
        try:
            answers = tier.handle.lookup(ask)
        except Exception:  # noqa: BLE001 - a faulty tier holds nothing
            break
        hits.update(k for k, a in zip(ask, answers, strict=True) if a is Lookup.HIT)
        ask = [k for k, a in zip(ask, answers, strict=True) if a is Lookup.RETRY]
        if not ask or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    return hits


class ModelWeights(ClosesManager):
    """A model's tensors (an ``nn.Module``: its parameters and buffers; or a mapping name ->
    tensor) and a tier stack from a kvtiers JSON config (a mapping, JSON text or a file path).

    ``name``, ``revision`` (a label, or None), ``rank``, ``world_size``: the model's identity (see
    :class:`WeightsIdentity`), whose content digest is taken afresh at every :meth:`publish` and
    level-2 :meth:`sleep`. ``chunk_bytes``: the arena's slot size (a multiple of 4096). The
    arena holds ``host_bytes``, or ``host_blocks_factor`` times the model's size. ``timeout``:
    seconds any one step may take before it is a ``TimeoutError`` (the model stays as it was).
    The config's ``kv_events``, ``metrics`` and ``serve`` blocks are for KV and not used here.
    ``close()`` closes the tiers and the arena (a sleeping model's tensors stay empty).
    """

    closed_message = "weights: closed"

    def __init__(self, model: Any, config: Any, *, name: str, revision: str | None = None, rank: int = 0,
                 world_size: int = 1, chunk_bytes: int = DEFAULT_CHUNK_BYTES, pin: bool | None = None,
                 timeout: float = 600.0) -> None:
        from ..config import Config, load_config
        from .arena import arena_size, create_host_arena
        from .manager import TieringManager

        if not isinstance(name, str) or not name:
            raise ValueError(f"weights: name must be a non-empty string, got {name!r}")
        if revision is not None and (not isinstance(revision, str) or not revision):
            raise ValueError(f"weights: revision must be a non-empty string or None, got {revision!r}")
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0 or chunk_bytes % PAGE:
            raise ValueError(f"weights: chunk_bytes must be a positive multiple of {PAGE}, got {chunk_bytes!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"weights: rank {rank} is not in 0..{world_size - 1}")
        self.cfg = config if isinstance(config, Config) else load_config(config)
        self.name, self.rank, self.world_size, self.chunk_bytes = name, rank, world_size, chunk_bytes
        self.revision = revision
        self._digest: str | None = None  # of the bytes last published, or of the identity forked
        self._asleep_keys: list[bytes] = []  # the data keys a wake loads
        self.timeout = timeout
        self.plan = WeightPlan(model, chunk_bytes)
        self.model = model
        manifest_chunks = -(-len(manifest_bytes(self.plan.describe())) // chunk_bytes)
        num_slots = arena_size(self.cfg.host_bytes, chunk_bytes, host_blocks_factor=self.cfg.host_blocks_factor,
                               device_chunk_capacity=self.plan.num_chunks + manifest_chunks)
        self.host = create_host_arena(num_slots, chunk_bytes, pin=pin, elastic=self.cfg.elastic,
                                      elastic_reserve_bytes=self.cfg.elastic_reserve_bytes)
        try:
            advise_huge(self.host.address, self.host.nbytes)
            self.copier = WeightCopier(self.host, self.plan)
            self.manager = TieringManager(arena=self.host.arena, dma=self.copier, chunk_bytes=chunk_bytes,
                                          eviction_policy=self.cfg.eviction_policy, offload_prompt_only=False,
                                          host=self.host, tier_job_timeout=min(timeout, 60.0))
        except BaseException:  # e.g. an unknown eviction policy: nothing is left open
            self.host.close()
            raise
        self._tiers_open = False
        self.asleep = 0  # 0 awake, else the level it sleeps at
        self._closed = False

    # -- identity -------------------------------------------------------------------------
    @property
    def identity(self) -> WeightsIdentity:
        """The identity of the bytes last published (by :meth:`publish` or a level-2 sleep) or
        forked; before any, of the bytes the model holds now (their digest is taken then)."""
        if self._digest is None:
            if self.asleep:
                raise RuntimeError("weights: the content digest is taken while awake")
            self._digest = self._content_digest()
        return WeightsIdentity(self.name, self.revision, self.rank, self.world_size, self.chunk_bytes, self._digest)

    def _content_digest(self) -> str:
        """xxh3-128 of every storage's bytes, in plan order (32 hex digits)."""
        h = xxhash.xxh3_128()
        for view in self._regions():
            h.update(memoryview(view if isinstance(view, np.ndarray) else view.cpu().numpy()))
        return h.hexdigest()

    def sleep(self, level: int = 1) -> WeightsStep:
        """Copy every tensor to the arena (level 1) and on to every tier (level 2), then free
        the device memory. Level 1 needs an arena that holds the model; level 2 needs a tier.
        Anything that fails before the memory is freed leaves the model awake."""
        self._check_open()
        if level not in (1, 2):
            raise ValueError(f"weights: sleep level must be 1 or 2, got {level!r}")
        if self.asleep:
            raise RuntimeError(f"weights: the model already sleeps (level {self.asleep})")
        self.plan.check_current()
        n = self.plan.num_chunks
        if level == 1 and len(self.host.arena) < n:
            raise ValueError(f"weights: sleep(1) needs a host arena of {n} chunks ({n * self.chunk_bytes} bytes) "
                             f"for the model's {self.plan.total_bytes} bytes; it has {len(self.host.arena)}: "
                             f"raise host_bytes, or sleep(2) through the tiers")
        if level == 2 and not self.cfg.tiers:
            raise ValueError("weights: sleep(2) needs a tier in the config ('tiers')")
        give_back_memory({"cpu"})  # RSS before and after both after a trim: the drop is the model's
        rss0, t0 = rss_bytes(), time.perf_counter()
        if level == 2:
            self._publish()
            keys = self._data_keys()
        else:
            keys = [_HOST_KEY % i for i in range(n)]
            self._drop_host(keys)
            self.copier.regions = self._regions()
            self._store(list(enumerate(keys)), batch=n)
        self.copier.regions = []
        seconds = time.perf_counter() - t0
        free_storages(self.plan.storages)
        if level == 2:
            self._drop_host(keys + self._manifest_keys(), release=True)
        self._asleep_keys = keys
        self.asleep = level
        return WeightsStep("sleep", self.plan.total_bytes, seconds, {}, rss0, rss_bytes())

    def wake(self) -> WeightsStep:
        """Bring every tensor back, byte-exact, into the model's own tensor objects, from the
        arena or the first tier that has its chunks."""
        self._check_open()
        if not self.asleep:
            raise RuntimeError("weights: the model is awake")
        self.plan.check_current()
        rss0, t0 = rss_bytes(), time.perf_counter()
        restore_storages(self.plan.storages)
        keys = self._asleep_keys
        sources = self._fill(keys)
        if self.asleep == 2:
            self._check_filled("wake")
        self.asleep = 0
        step = WeightsStep("wake", self.plan.total_bytes, time.perf_counter() - t0, sources, rss0, rss_bytes())
        self._drop_host(keys, release=True)  # the tensors hold the bytes again
        return step

    def publish(self) -> WeightsIdentity:
        """Store the (awake) model's chunks and manifest in every tier, so that other processes
        can :meth:`fork` it; returns the identity they need (with the digest of the bytes now;
        chunks every tier already holds are not stored again). The host copies are dropped."""
        self._check_open()
        if self.asleep:
            raise RuntimeError("weights: publish an awake model (a sleeping one at level 2 is published)")
        if not self.cfg.tiers:
            raise ValueError("weights: publish needs a tier in the config ('tiers')")
        self.plan.check_current()
        self._publish()
        self.copier.regions = []
        self._drop_host(self._data_keys() + self._manifest_keys(), release=True)
        return self.identity

    @classmethod
    def fork(cls, model: Any, config: Any, identity: WeightsIdentity | Mapping[str, Any], *,
             pin: bool | None = None, timeout: float = 600.0) -> ModelWeights:
        """Fill ``model``'s tensors (allocated, e.g. ``model.to_empty(device=...)``) from the
        weights another process published under ``identity``, instead of reading the checkpoint.
        A tensor that is missing, extra or of another dtype, shape or layout is a ``ValueError``
        naming it; weights no tier has (or a damaged manifest) are a ``LookupError``; bytes that
        do not match the identity's digest are a ``RuntimeError``. Returns the handle
        (``.last_step`` says what was moved); close it when done."""
        ident = identity if isinstance(identity, WeightsIdentity) else WeightsIdentity.from_dict(identity)
        self = cls(model, config, name=ident.name, revision=ident.revision, rank=ident.rank,
                   world_size=ident.world_size, chunk_bytes=ident.chunk_bytes, pin=pin, timeout=timeout)
        try:
            if not ident.digest:
                raise LookupError(f"weights: no tier holds the weights of {ident}: the identity names no content "
                                  f"digest (fork with the identity publish() returned)")
            self._digest = ident.digest
            if not self.cfg.tiers:
                raise ValueError("weights: fork needs a tier in the config ('tiers')")
            t0 = time.perf_counter()
            rss0 = rss_bytes()
            self._open_tiers()
            restore_storages(self.plan.storages, swap=True)  # fresh memory in huge pages, as wake gives it
            doc = self._read_manifest()
            try:
                self.plan.check_manifest(doc, str(ident))
            except (KeyError, TypeError, AttributeError) as e:  # valid JSON of another shape
                raise LookupError(f"weights: the manifest of {ident} is damaged: {type(e).__name__} {e}") from None
            sources = self._fill(self._data_keys())
            self._check_filled("fork")
            self.last_step = WeightsStep("fork", self.plan.total_bytes, time.perf_counter() - t0, sources,
                                         rss0, rss_bytes())
            self._drop_host(self._data_keys(), release=True)
        except BaseException:
            self.close()
            raise
        return self

    # -- internals ------------------------------------------------------------------------
    def _data_keys(self) -> list[bytes]:
        """The tier keys of the data chunks of the bytes last published (or forked)."""
        d = self.identity.digest.encode()
        return [_CHUNK_KEY % (d, i) for i in range(self.plan.num_chunks)]

    def _manifest_keys(self) -> list[bytes]:
        n = -(-len(self.copier.manifest) // self.chunk_bytes) if len(self.copier.manifest) else 0
        d = self.identity.digest.encode()
        return [_MANIFEST_KEY % (d, j) for j in range(n)]

    def _check_filled(self, action: str) -> None:
        """After a fill from the tiers: the bytes are those of the identity, or a loud error."""
        got = self._content_digest()
        if got != self._digest:
            raise RuntimeError(f"weights: {action} filled bytes whose digest {got} is not that of {self.identity}; "
                               f"a tier returned other bytes than were published")

    def _regions(self) -> list[Any]:
        """One ``uint8`` view per storage: numpy for CPU storages, a tensor on accelerators."""
        out = []
        for s in self.plan.storages:
            v = uint8_view(s.tensors[0].untyped_storage())
            out.append(v.numpy() if v.device.type == "cpu" else v)
        return out

    def _open_tiers(self) -> None:
        if not self._tiers_open:
            self.manager.namespace = self.identity.namespace()
            for t in self.cfg.tiers:
                self.manager.add_tier(t.type, t.options, name=t.name)
            self._tiers_open = True

    def _publish(self) -> None:
        """Chunks and manifest into the arena and on to every tier; checked there. The digest of
        the bytes is taken afresh (the model may have changed in place since the last publish),
        and chunks every tier already holds under it are not stored again."""
        self._open_tiers()
        self._digest = self._content_digest()
        self.copier.manifest = np.frombuffer(bytearray(manifest_bytes(self.plan.describe())), dtype=np.uint8)
        keys = self._data_keys() + self._manifest_keys()
        self._drop_host(keys)  # never reuse host copies of earlier bytes
        held = self._held_by_every_tier(keys)
        todo = [(i, k) for i, k in enumerate(keys) if k not in held]
        if todo:
            self.copier.regions = self._regions()
            self._store(todo, batch=max(1, len(self.host.arena) // 2))
            self._settle()
        missing = [i for i, k in enumerate(keys) if not self._in_tier(k)]
        if missing:
            data = [i for i in missing if i < self.plan.num_chunks]
            what = f"tensors {self.plan.tensors_in(data)}" if data else "the manifest"
            raise RuntimeError(f"weights: {len(missing)} chunk(s) of {what} were stored by no tier "
                               f"(tier errors: {dict(self.manager.stats.tier_errors)}); the model stays awake")

    def _store(self, items: list[tuple[int, bytes]], batch: int) -> None:
        """Store chunks ``(id, key)`` into the arena, ``batch`` per call; keys that find no free
        slot (the arena is full of chunks still going to the tiers) are tried again."""
        mgr, deadline = self.manager, time.monotonic() + self.timeout
        queue, ids = deque(items), {k: i for i, k in items}
        inflight: set[int] = set()
        pause = 0.0002
        while queue or inflight:
            if queue and len(inflight) < 2:
                take = [queue.popleft() for _ in range(min(batch, len(queue)))]
                inflight.add(mgr.store([k for _, k in take], [[i] for i, _ in take]))
            progressed = False
            for r in mgr.get_finished():
                inflight.discard(r.transfer_id)
                queue.extend((ids[k], k) for k in r.skipped_keys)
                progressed = progressed or len(r.skipped_keys) < len(r.keys)
            if progressed:
                pause = 0.0002
            elif queue or inflight:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weights: {len(queue)} chunk(s) found no arena slot within "
                                       f"{self.timeout:g} s; the model stays awake")
                time.sleep(pause)
                pause = min(pause * 2, 0.005)

    def _settle(self) -> None:
        """Wait for every tier job in flight."""
        deadline = time.monotonic() + self.timeout
        while self.manager.pending():
            if time.monotonic() > deadline:
                raise TimeoutError(f"weights: tier jobs unfinished after {self.timeout:g} s; the model stays awake")
            self.manager.poll()
            time.sleep(0.001)

    def _held_by_every_tier(self, keys: list[bytes]) -> set[bytes]:
        """The keys every tier answers HIT for (RETRY asked again for up to 5 s)."""
        held = set(keys)
        for tier in self.manager.tiers:
            held &= tier_hits(tier, list(held))
            if not held:
                break
        return held

    def _in_tier(self, key: bytes) -> bool:
        """Whether some tier answers HIT for ``key`` (RETRY asked again for up to 5 s)."""
        return any(tier_hits(tier, [key]) for tier in self.manager.tiers)

    def _fill(self, keys: list[bytes]) -> dict[str, int]:
        """Load every data chunk (under ``keys``) into the model's storages; chunks per source."""
        self.copier.regions = self._regions()
        try:
            return self._load(list(enumerate(keys)))
        finally:
            self.copier.regions = []

    def _load(self, items: list[tuple[int, bytes]]) -> dict[str, int]:
        """Load chunks ``(id, key)`` with several loads in flight (no more chunks than the arena
        has slots, so every wave finds slots); a key that failed while some tier still has it is
        tried again, up to three times."""
        mgr, deadline = self.manager, time.monotonic() + self.timeout
        cap = len(self.host.arena)
        batch = max(1, min(cap // 4, 64))
        queue, ids = deque(items), {k: i for i, k in items}
        inflight: dict[int, int] = {}
        tries: Counter[bytes] = Counter()
        sources: Counter[str] = Counter()
        while queue or inflight:
            while queue and sum(inflight.values()) + min(batch, len(queue)) <= cap:
                take = [queue.popleft() for _ in range(min(batch, len(queue)))]
                tid = mgr.load([k for _, k in take], [[i] for i, _ in take])
                inflight[tid] = len(take)
            for r in mgr.get_finished():
                inflight.pop(r.transfer_id, None)
                sources.update(v for k, v in r.sources.items())
                for k in r.failed_keys:
                    tries[k] += 1
                    if tries[k] > 3 or not (k in mgr.cache or self._in_tier(k)):
                        what = (f"tensors {self.plan.tensors_in([ids[k]])}" if ids[k] < self.plan.num_chunks
                                else "the manifest")
                        raise LookupError(f"weights: chunk {k.decode()} ({what}) of {self.identity} is in no tier "
                                          f"({r.error or 'missing'})")
                    queue.append((ids[k], k))
            if inflight:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weights: loads unfinished after {self.timeout:g} s")
                mgr.poll()
                time.sleep(0.0002)
        return dict(sources)

    def _read_manifest(self) -> dict[str, Any]:
        """The published manifest, read from the tiers. One that is damaged (a wrong magic, a
        length beyond any this model could have, text that is not its JSON) is a ``LookupError``
        naming the identity, as a missing one is."""
        d = self.identity.digest.encode()
        first = _MANIFEST_KEY % (d, 0)
        if not self._in_tier(first):
            raise LookupError(f"weights: no tier holds the weights of {self.identity} (no manifest)")
        n = self.plan.num_chunks
        self.copier.manifest = np.zeros(self.chunk_bytes, dtype=np.uint8)
        try:
            self._load([(n, first)])
            total = manifest_length(self.copier.manifest)
            # the published model has this model's tensors (checked next), so its manifest is
            # about as long as ours: far more is a damaged length, not a reason to allocate it
            limit = 4 * len(manifest_bytes(self.plan.describe())) + self.chunk_bytes
            if total > limit:
                raise ValueError(f"it says {total} bytes, more than the {limit} a manifest of this model can have")
            more = -(-total // self.chunk_bytes)
            if more > 1:
                buf = np.zeros(more * self.chunk_bytes, dtype=np.uint8)
                buf[: self.chunk_bytes] = self.copier.manifest
                self.copier.manifest = buf
                self._load([(n + j, _MANIFEST_KEY % (d, j)) for j in range(1, more)])
            doc = parse_manifest(self.copier.manifest)
            if not isinstance(doc, dict):
                raise ValueError(f"it holds a JSON {type(doc).__name__}, not an object")
        except (ValueError, UnicodeDecodeError) as e:  # json's JSONDecodeError is a ValueError
            raise LookupError(f"weights: the manifest of {self.identity} is damaged: {e}") from None
        finally:
            self._drop_host(self._manifest_keys())
            self.copier.manifest = np.zeros(0, dtype=np.uint8)
        return doc

    def _drop_host(self, keys: list[bytes], release: bool = False) -> None:
        """Forget ``keys`` in the host cache; with ``release``, give the pages of their (unpinned)
        slots back where the arena is elastic."""
        cache, freed = self.manager.cache, []
        for k in keys:
            slot = cache.slot(k)
            if slot is not None and cache.drop(k) and not cache.is_pinned(slot):
                freed.append(slot)
        if release and freed and self.host.elastic:
            self.host.release(freed)
