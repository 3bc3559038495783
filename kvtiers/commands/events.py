"""``kvtiers events tail``: subscribe to a KV event publisher (kvtiers' or vLLM's) and print
what it sends, one line per event or ``--json``.

The wire format is vLLM's (docs/observability.md): three frames per batch (topic, 8-byte
big-endian sequence number, msgpack ``[ts, [events], data_parallel_rank]``); events are
maps tagged under ``"type"`` or, from older publishers, positional arrays. A jump in the
sequence numbers is reported on stderr and, with ``--replay-endpoint``, filled from the
publisher's replay buffer before going on. Needs pyzmq and msgspec (the ``observe``
extra); no torch.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from typing import Any

import click
import msgspec
import zmq

__all__ = ["Tail", "decode_batch", "events", "normalize_event"]

END_SEQ = -1
# positional (older vLLM) layouts: field names after the tag, in order
POSITIONAL = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
                    "ownership", "session_id", "lookahead_token_ids"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}


def normalize_event(ev: Any) -> dict[str, Any]:
    """An event as a dict with ``"type"``, from either encoding."""
    if isinstance(ev, dict):
        return dict(ev)
    if isinstance(ev, (list, tuple)) and ev and isinstance(ev[0], str):
        names = POSITIONAL.get(ev[0], ())
        return {"type": ev[0], **dict(zip(names, ev[1:], strict=False))}
    return {"type": "?", "raw": ev}


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """``(ts, events, data_parallel_rank)`` of one batch payload."""
    obj = msgspec.msgpack.decode(payload)
    if isinstance(obj, dict):  # a map-encoded batch
        ts, evs, rank = obj.get("ts"), obj.get("events", []), obj.get("data_parallel_rank")
    else:
        ts, evs, rank = obj[0], obj[1], (obj[2] if len(obj) > 2 else None)
    return ts, [normalize_event(e) for e in evs], rank


def _hex(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, list):
        return [_hex(x) for x in v]
    return v


class Tail:
    """The subscriber: sequence tracking, gap reports and replay, printing through ``out``.

    ``expected``: the first sequence number wanted (batches before it that are missing
    count as a gap; ``None``: start from whatever comes first).
    """

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 expected: int | None = 0, as_json: bool = False, out: Any = None, err: Any = None,
                 replay_timeout: float = 5.0) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.expected = expected
        self.as_json = as_json
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.replay_timeout = replay_timeout
        self.batches = 0
        self.events: Counter = Counter()
        self.gaps = 0
        self.filled = 0  # batches recovered through replay
        self.lost = 0  # batches neither received nor replayed

    def poll(self, timeout_ms: int) -> bool:
        """Handle one batch if one arrives within ``timeout_ms``; True if one did."""
        if not self.sub.poll(timeout_ms):
            return False
        frames = self.sub.recv_multipart()
        if len(frames) != 3:
            print(f"kvtiers events: ignored a message of {len(frames)} frames", file=self.err)
            return True
        _, seq_b, payload = frames
        self.receive(int.from_bytes(seq_b, "big", signed=True), payload)
        return True

    def receive(self, seq: int, payload: bytes) -> None:
        if self.expected is None:
            self.expected = seq
        if seq == 0 and self.expected > 1:  # a new publisher on the endpoint: its numbering starts over
            print(f"kvtiers events: sequence restarted at 0 (after {self.expected - 1}): a new publisher",
                  file=self.err)
            self.expected = 0
        if seq < self.expected:
            return  # seen already (through replay)
        if seq > self.expected:
            self._gap(self.expected, seq)
        self._emit(seq, payload)

    def _gap(self, first: int, upto: int) -> None:
        """Batches ``first .. upto-1`` did not arrive: replay them if possible."""
        self.gaps += 1
        print(f"kvtiers events: gap: batches {first}..{upto - 1} missing", file=self.err)
        got = self._replay(first, upto) if self.replay_endpoint else {}
        for s in range(first, upto):
            if s in got:
                self.filled += 1
                self._emit(s, got[s])
        missing = [s for s in range(first, upto) if s not in got]
        if missing:
            self.lost += len(missing)
            print(f"kvtiers events: lost {len(missing)} batch(es) ({missing[0]}..{missing[-1]}): "
                  f"{'not in the replay buffer' if self.replay_endpoint else 'no --replay-endpoint'}", file=self.err)
        else:
            print(f"kvtiers events: gap filled through replay ({upto - first} batch(es))", file=self.err)
        self.expected = upto

    def _replay(self, first: int, upto: int) -> dict[int, bytes]:
        """Ask the replay socket for batches from ``first`` on; keep those before ``upto``."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: dict[int, bytes] = {}
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", first.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout
            while time.monotonic() < deadline:
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 4:  # b"", topic, seq, payload
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    break
                if first <= seq < upto:
                    got[seq] = frames[3]
        finally:
            sock.close()
        return got

    def _emit(self, seq: int, payload: bytes) -> None:
        self.expected = seq + 1
        self.batches += 1
        try:
            ts, evs, rank = decode_batch(payload)
        except Exception as e:
            print(f"kvtiers events: batch {seq}: cannot decode ({type(e).__name__}: {e})", file=self.err)
            return
        for ev in evs:
            self.events[ev["type"]] += 1
            if self.as_json:
                line = json.dumps({"seq": seq, "ts": ts, "data_parallel_rank": rank,
                                   **{k: _hex(v) for k, v in ev.items()}})
            else:
                hashes = ev.get("block_hashes") or []
                first = _hex(hashes[0]) if hashes else "-"
                line = (f"{seq:>6} {ev['type']:<16} {ev.get('medium') or '-':<8} {ev.get('ownership') or '-':<10} "
                        f"{len(hashes):>4} blocks  {str(first)[:16]}")
            print(line, file=self.out)
        self.out.flush()

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.events.items())) or "none"
        return (f"kvtiers events: {self.batches} batches, events: {kinds}; gaps {self.gaps}, "
                f"filled {self.filled}, lost {self.lost}")

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


@click.group()
def events() -> None:
    """KV events in vLLM's wire format (ZMQ, msgpack): watch a publisher."""


@events.command()
@click.option("--endpoint", required=True, help="The publisher's PUB endpoint, e.g. tcp://127.0.0.1:5557.")
@click.option("--replay-endpoint", default=None, help="Its ROUTER replay endpoint: gaps are filled from there.")
@click.option("--topic", default="", help="Subscribe to this topic (prefix); default: all.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event (hashes as hex).")
@click.option("--from-seq", default=0, show_default=True, type=int,
              help="First sequence number wanted; earlier missing batches are a gap. -1: from the first received.")
@click.option("--count", type=click.IntRange(1), default=None, help="Exit after this many batches.")
@click.option("--idle-timeout", type=float, default=None,
              help="Exit after this many seconds without a batch (once one arrived).")
@click.option("--timeout", "total_timeout", type=float, default=None, help="Exit after this many seconds in all.")
def tail(endpoint: str, replay_endpoint: str | None, topic: str, as_json: bool, from_seq: int, count: int | None,
         idle_timeout: float | None, total_timeout: float | None) -> None:
    """Print the events a publisher sends, reporting (and with --replay-endpoint filling)
    gaps in the sequence numbers. A summary goes to stderr at exit; the exit status is 1
    if batches were lost (a gap replay could not fill)."""
    t = Tail(endpoint, replay_endpoint=replay_endpoint, topic=topic, expected=None if from_seq < 0 else from_seq,
             as_json=as_json)
    start = last = time.monotonic()
    try:
        while True:
            if t.poll(100):
                last = time.monotonic()
                if count is not None and t.batches >= count:
                    break
                continue
            now = time.monotonic()
            if total_timeout is not None and now - start >= total_timeout:
                break
            if idle_timeout is not None and t.batches and now - last >= idle_timeout:
                break
    except KeyboardInterrupt:
        pass
    finally:
        click.echo(t.summary(), err=True)
        t.close()
    if t.lost:
        raise click.exceptions.Exit(1)
