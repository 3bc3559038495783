"""KV events: vLLM 0.33's wire format, decoded with msgspec structs written from its
definitions; the older positional form; self-describing stores; replay; a subscriber in
another process that sees every event of a demo run; ``kvtiers events tail`` filling gaps."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from tier_helpers import CopyDma

from kvtiers import Arena, Request
from kvtiers.commands.events import Tail
from kvtiers.engine.kvevents import KVEventPublisher, KVEventsConfig, attach_kv_events, parse_kv_events
from kvtiers.engine.manager import TieringManager
from kvtiers.errors import ConfigError

TESTS = Path(__file__).resolve().parent
SLOT = 4096


# -- vLLM 0.33's definitions (vllm/distributed/kv_events.py), as a consumer writes them -----

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, forbid_unknown_fields=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# -- the older, positional layout (array_like events, tag first) ---------------------------

class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class OldBlockRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class OldAllBlocksCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]
    data_parallel_rank: int | None = None


# -- helpers --------------------------------------------------------------------------------

def manager(slots: int = 4, tier_bytes: int | None = 6 * SLOT, blocks_per_chunk: int = 1) -> TieringManager:
    mgr = TieringManager(arena=Arena.allocate(slots, SLOT), dma=CopyDma(), blocks_per_chunk=blocks_per_chunk,
                         tokens_per_chunk=16 * blocks_per_chunk)
    mgr.add_tier("memory", {"max_bytes": tier_bytes}, name="ram")
    return mgr


def subscriber(endpoint: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return ctx, sub


def wait_subscribed(pub: KVEventPublisher, sub: zmq.Socket) -> None:
    """PUB drops what it sends before a subscription arrives: probe until one gets through."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pub._pub.send_multipart((b"probe", b"\xff" * 8, b""))  # not a batch: no sequence number used
        if sub.poll(50):
            sub.recv_multipart()
            return
    raise AssertionError("subscription never arrived")


def drain(sub: zmq.Socket, idle_ms: int = 500) -> list[tuple[bytes, int, bytes]]:
    out = []
    while sub.poll(idle_ms):
        topic, seq, payload = sub.recv_multipart()
        if topic != b"probe":
            out.append((topic, int.from_bytes(seq, "big", signed=True), payload))
    return out


def store_all(mgr: TieringManager, n: int, request: Any = None, prefix: bytes = b"k", bpc: int = 1) -> list[bytes]:
    keys = [prefix + bytes([i]) for i in range(n)]
    for i, k in enumerate(keys):
        mgr.wait([mgr.store([k], list(range(bpc)), request, first_chunk=i)])
    deadline = time.monotonic() + 10
    while mgr.pending() and time.monotonic() < deadline:
        mgr.poll()
        time.sleep(0.001)
    return keys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- tests ----------------------------------------------------------------------------------

def test_events_decode_with_vllm_033_structs_and_match_the_managers_counts() -> None:
    mgr = manager()
    bridge = attach_kv_events(mgr, {"endpoint": "tcp://127.0.0.1:0", "topic": "kv@pod@model"})
    ctx, sub = subscriber(bridge.publisher.endpoint)
    try:
        wait_subscribed(bridge.publisher, sub)
        store_all(mgr, 8)  # 4 host slots, 6 in the tier: both evict
        mgr.close()
        frames = drain(sub)
    finally:
        sub.close(linger=0)
        ctx.term()
    assert frames and {t for t, _, _ in frames} == {b"kv@pod@model"}
    assert [s for _, s, _ in frames] == list(range(len(frames)))  # 8-byte big-endian, from 0, no gap
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    blocks: Counter = Counter()
    for _, _, payload in frames:
        batch = decoder.decode(payload)
        assert batch.data_parallel_rank == 0 and batch.ts > 1e9
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list) and len(raw) == 3  # the batch is positional: [ts, events, rank]
        for ev, raw_ev in zip(batch.events, raw[1], strict=True):
            assert raw_ev["type"] == type(ev).__name__  # events are maps tagged under "type"
            # fields without a default are always written, optional ones at their default never
            assert "medium" in raw_ev and "group_idx" not in raw_ev and "extra_keys" not in raw_ev
            assert ev.locality == "LOCAL"
            if isinstance(ev, BlockStored):
                assert {"parent_block_hash", "lora_id", "lora_name", "token_ids"} <= raw_ev.keys()
                assert ev.token_ids == [] and ev.parent_block_hash is None and ev.block_size == 16
            blocks[type(ev).__name__, ev.medium, ev.ownership] += len(ev.block_hashes)
    own = mgr.stats.events
    assert own["removed", "host"] > 0 and own["removed", "ram"] > 0  # evictions in both
    assert blocks == {
        ("BlockStored", "CPU", None): own["stored", "host"], ("BlockRemoved", "CPU", None): own["removed", "host"],
        ("BlockStored", "STORAGE", "ram"): own["stored", "ram"],
        ("BlockRemoved", "STORAGE", "ram"): own["removed", "ram"],
    }


def test_positional_encoding_decodes_as_the_older_layout() -> None:
    mgr = manager()
    bridge = attach_kv_events(mgr, {"endpoint": "tcp://127.0.0.1:0", "encoding": "array"})
    ctx, sub = subscriber(bridge.publisher.endpoint)
    try:
        wait_subscribed(bridge.publisher, sub)
        keys = store_all(mgr, 6)
        bridge.cleared()
        mgr.close()
        frames = drain(sub)
    finally:
        sub.close(linger=0)
        ctx.term()
    events = [ev for _, _, p in frames for ev in msgspec.msgpack.decode(p, type=OldBatch).events]
    raw = [ev for _, _, p in frames for ev in msgspec.msgpack.decode(p)[1]]
    assert all(isinstance(r, list) for r in raw)
    assert {len(r) for r in raw if r[0] == "BlockStored"} == {8}
    assert {len(r) for r in raw if r[0] == "BlockRemoved"} == {3}
    stored = [e for e in events if isinstance(e, OldBlockStored)]
    assert {k for e in stored if e.medium == "CPU" for k in e.block_hashes} == set(keys)
    assert {k for e in stored if e.medium == "STORAGE" for k in e.block_hashes} == set(keys)
    assert any(isinstance(e, OldBlockRemoved) and e.medium == "CPU" for e in events)
    assert isinstance(events[-1], OldAllBlocksCleared)


def test_self_describing_stores_fan_chunks_out_to_their_blocks() -> None:
    mgr = manager(slots=3, tier_bytes=None, blocks_per_chunk=2)
    bridge = attach_kv_events(mgr, {"endpoint": "tcp://127.0.0.1:0", "self_describing": True})
    ctx, sub = subscriber(bridge.publisher.endpoint)
    hashes = [1000 + b for b in range(6)]  # 3 chunks of 2 blocks of 4 tokens
    req = Request("r", token_ids=list(range(24)), block_hashes=hashes, parent_block_hash=b"root", block_size=4)
    try:
        wait_subscribed(bridge.publisher, sub)
        mgr.wait([mgr.store([b"c0", b"c1", b"c2"], [[0, 1], [2, 3], [4, 5]], req)])
        store_all(mgr, 1, prefix=b"x", bpc=2)  # one more chunk, not described: evicts c0 from the host
        mgr.close()
        frames = drain(sub)
    finally:
        sub.close(linger=0)
        ctx.term()
    events = [ev for _, _, p in frames for ev in msgspec.msgpack.decode(p, type=KVEventBatch).events]
    host = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size) for e in host[:3]] == [
        ([1000, 1001], b"root", list(range(0, 8)), 4),
        ([1002, 1003], 1001, list(range(8, 16)), 4),
        ([1004, 1005], 1003, list(range(16, 24)), 4),
    ]
    # the tier stored all three chunks in one job: one chained run of six blocks
    tier, plain = [e for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    assert plain.block_hashes == [b"x\x00"] and plain.ownership == "ram"
    assert (tier.block_hashes, tier.parent_block_hash, tier.token_ids) == (hashes, b"root", list(range(24)))
    # evicted from the 3-slot host: the removal names the chunk's blocks, not its key
    removed = [(e.medium, e.block_hashes) for e in events if isinstance(e, BlockRemoved)]
    assert removed == [("CPU", [1000, 1001])]
    assert (host[3].block_hashes, host[3].token_ids, host[3].block_size) == ([b"x\x00"], [], 32)  # a plain chunk


def test_replay_answers_from_start_seq_then_ends_with_minus_one() -> None:
    pub = KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                                          topic="t", buffer_steps=3))
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    try:
        seqs = [pub.publish([{"type": "AllBlocksCleared"}]) for _ in range(5)]
        assert seqs == [0, 1, 2, 3, 4]
        deadline = time.monotonic() + 10
        while pub.published < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        req.connect(pub.replay_endpoint)
        req.send_multipart([b"", (1).to_bytes(8, "big")])
        replies = []
        while True:
            assert req.poll(10_000), "replay did not answer"
            replies.append(req.recv_multipart())
            if replies[-1][2] == (-1).to_bytes(8, "big", signed=True):
                break
    finally:
        req.close(linger=0)
        ctx.term()
        pub.close()
    # buffer_steps=3 keeps 2, 3, 4; each reply is (empty delimiter, topic, seq, payload)
    assert [(r[0], r[1], int.from_bytes(r[2], "big")) for r in replies[:-1]] == [(b"", b"t", s) for s in (2, 3, 4)]
    assert replies[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert msgspec.msgpack.decode(replies[0][3], type=KVEventBatch).events == [AllBlocksCleared()]


def test_config_block_is_checked() -> None:
    assert parse_kv_events({"enable": False}) is None and parse_kv_events({"publisher": "null"}) is None
    cfg = parse_kv_events({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "buffer_steps": 10})
    assert cfg.buffer_steps == 10 and cfg.encoding == "map"
    with pytest.raises(ConfigError, match="kv_events: unknown key 'bufer_steps'"):
        parse_kv_events({"bufer_steps": 3})
    with pytest.raises(ConfigError, match="kv_events.encoding expects 'map' or 'array'"):
        parse_kv_events({"encoding": "positional"})


def test_tail_reports_and_fills_a_gap_through_replay() -> None:
    pub = KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0"))
    send = pub._pub.send_multipart
    drop: set[bytes] = set()

    def lossy(frames, *a, **kw):  # fault injection: a batch that never leaves on the PUB socket
        if frames[1] in drop:
            return None
        return send(frames, *a, **kw)

    pub._pub.send_multipart = lossy
    cmd = [sys.executable, "-m", "kvtiers.commands", "events", "tail", "--endpoint", pub.endpoint,
           "--replay-endpoint", pub.replay_endpoint, "--json", "--idle-timeout", "2", "--timeout", "90"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        first = None
        deadline = time.monotonic() + 60
        while first is None and time.monotonic() < deadline:  # until the subscriber is up
            pub.publish([{"type": "BlockStored", "block_hashes": [b"\x00"], "medium": "CPU"}])
            try:
                first = lines.get(timeout=0.2)
            except queue.Empty:
                pass
        assert first is not None, "the subscriber never printed"
        n = pub._seq
        drop.add((n + 1).to_bytes(8, "big"))
        for i in range(4):
            pub.publish([{"type": "BlockRemoved", "block_hashes": [bytes([i])], "medium": "CPU"}])
        proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.close()
    out = [first]
    while not lines.empty():
        out.append(lines.get())
    assert proc.returncode == 0, err
    events = [json.loads(x) for x in out]
    assert [e["seq"] for e in events] == list(range(n + 4))  # early ones replayed if they came too soon
    assert events[n + 1]["block_hashes"] == ["01"] and events[n + 1]["type"] == "BlockRemoved"
    assert f"gap: batches {n + 1}..{n + 1} missing" in err and "gap filled through replay" in err
    assert "lost 0" in err


def test_tail_without_replay_reports_lost_batches() -> None:
    pub = KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:0"))
    seen: list[str] = []

    class Lines:
        def write(self, s: str) -> None:
            seen.append(s)

        def flush(self) -> None:
            pass

    tail = Tail(pub.endpoint, as_json=True, out=Lines(), err=Lines())
    try:
        wait_subscribed(pub, tail.sub)
        tail.expected = 3  # as if batches 0-2 were seen
        with pub._lock:
            pub._seq = 5  # ... and 3 and 4 dropped before they were sent
        for _ in range(2):
            pub.publish([{"type": "AllBlocksCleared"}])
        deadline = time.monotonic() + 10
        while tail.batches < 2 and time.monotonic() < deadline:
            tail.poll(100)
    finally:
        tail.close()
        pub.close()
    assert tail.lost == 2 and tail.gaps == 1 and tail.batches == 2
    assert any("lost 2 batch(es) (3..4): no --replay-endpoint" in s for s in seen)


@pytest.mark.slow
def test_subscriber_in_another_process_gets_every_event_of_a_demo_run(tmp_path) -> None:
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tail = subprocess.Popen(
        [sys.executable, "-m", "kvtiers.commands", "events", "tail", "--endpoint", pub_ep,
         "--replay-endpoint", replay_ep, "--json", "--idle-timeout", "4", "--timeout", "200"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        config = {"host_bytes": 8 << 20, "tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv"),
                                                    "max_bytes": 24 << 20}]}
        demo = subprocess.run(
            [sys.executable, "-m", "kvtiers.commands", "demo", "--turns", "3", "--conversations", "4", "--json",
             "--events", pub_ep, "--events-replay", replay_ep, "--linger", "3", "--config", json.dumps(config)],
            capture_output=True, text=True, env=env, timeout=240)
        assert demo.returncode == 0, demo.stderr
        out, err = tail.communicate(timeout=120)
    finally:
        if tail.poll() is None:
            tail.kill()
    summary = json.loads(demo.stdout)
    assert tail.returncode == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    seqs = sorted({e["seq"] for e in events})
    assert seqs == list(range(summary["kv_events"]["batches"]))  # every batch, no gap left
    got: Counter = Counter()
    for e in events:
        got[e["type"], e["medium"], e.get("ownership")] += len(e["block_hashes"])
    own = summary["cache_events"]  # the manager's own counts: chunk keys per kind and medium
    assert own["removed"]["host"] > 0 and own["removed"]["fs"] > 0
    assert got == {
        ("BlockStored", "CPU", None): own["stored"]["host"], ("BlockRemoved", "CPU", None): own["removed"]["host"],
        ("BlockStored", "STORAGE", "fs"): own["stored"]["fs"], ("BlockRemoved", "STORAGE", "fs"): own["removed"]["fs"],
    }
    assert sum(summary["kv_events"]["events"].values()) == len(events)
