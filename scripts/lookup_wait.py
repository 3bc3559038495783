"""How long vLLM's scheduler waits on lookups with a kvtiers fs tier (``lookup_async_delay``).

Drives vLLM's real ``TieringOffloadingManager`` (built by ``TieringOffloadingSpec``) with a
real kvtiers fs tier on real files the way vLLM's offloading scheduler does: every step, each
waiting request (up to ``--concurrency`` running) scans its chunk keys in order (a MISS ends
the scan, RETRY and HIT_PENDING defer the request to the next step, as
``_maximal_prefix_lookup`` does); a request that is not deferred runs ``--run-steps`` steps,
then stores its chunks (the cascade to the tier); ``on_schedule_end`` ends every step and a
sleep of ``--step-ms`` stands for the model's forward pass. The workload is the one of
``vllm bench serve --dataset-name prefix_repetition``: prefixes x requests each, shuffled.

Prints the deferrals by cause (the tier's RETRY, a promotion's HIT_PENDING), and the total
"lookup not ready" time, which is what vLLM reports as ``lookup_async_delay``.

    .venv/bin/python scripts/lookup_wait.py [--retry-wait-ms 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import uuid

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvtiers.integrations.vllm import KvtiersOffloadingSpec

ROW = 8192
STEP = ScheduleEndContext((), ())


def make_manager(root: str, rows: int, tier_options: dict, extra: dict | None = None):
    """kvtiers' spec's (vLLM's) tiering manager: a primary tier of ``rows`` chunks and a kvtiers fs tier at ``root``."""
    par = OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                   data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                   is_parallelism_agnostic=True)
    tier = {"type": "kvtiers_fs", "module_path": "kvtiers.integrations.vllm", "root_dir": root, **tier_options}
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.attn",), group_id=0),),
        worker_kv_bytes_per_block=ROW, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": rows * ROW, "secondary_tiers": [tier], **(extra or {})},
        engine_id=f"lookup-wait-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="org/tiny-model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=par,
    )
    return KvtiersOffloadingSpec(cfg).get_manager()


class _Req:
    def __init__(self, rid: str, keys: list) -> None:
        self.ctx = ReqContext(req_id=rid)
        self.keys = keys
        for i, k in enumerate(keys):  # as the scheduler's update_offload_keys records them
            self.ctx.set_offload_key_position(k, (i + 1) * 16)
        self.deferred_since: float | None = None
        self.steps_left = 0
        self.hit = 0


def run(prefixes: int = 24, per_prefix: int = 8, chunks: int = 16, concurrency: int = 4, rows: int = 48,
        run_steps: int = 3, step_ms: float = 10.0, seed: int = 0, tier_options: dict | None = None,
        extra: dict | None = None) -> dict:
    """Run the workload once in a fresh directory; return the counts and times."""
    rng = random.Random(seed)
    keys = [[make_offload_key(rng.randbytes(32), 0) for _ in range(chunks)] for _ in range(prefixes)]
    order = [p for p in range(prefixes) for _ in range(per_prefix)]
    rng.shuffle(order)
    with tempfile.TemporaryDirectory(prefix="kvtiers-lookup-wait-") as root:
        m = make_manager(root, rows, tier_options or {}, extra)
        view = np.frombuffer(m.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(-1, ROW)
        out = {"requests": len(order), "deferrals": 0, "retry": 0, "hit_pending": 0, "delay_s": 0.0,
               "waits": 0, "hit_chunks": 0, "steps": 0}
        queue = [_Req(f"r{i}", keys[p]) for i, p in enumerate(order)]
        waiting: list[_Req] = []  # arrived, not running: each client has one request in flight
        running: list[_Req] = []
        t0 = time.monotonic()
        try:
            while queue or waiting or running:
                out["steps"] += 1
                for r in list(running):  # the forward pass of the step before: run, then store
                    r.steps_left -= 1
                    if r.steps_left == 0:
                        running.remove(r)
                        todo = r.keys[r.hit:]
                        spec = m.prepare_store(todo, r.ctx)
                        if spec is not None and spec.keys_to_store:
                            for row in spec.store_spec.block_ids:
                                view[row] = 1
                            m.complete_store(todo, r.ctx)
                        m.on_request_finished(r.ctx)
                while queue and len(waiting) + len(running) < concurrency:
                    waiting.append(queue.pop(0))
                    m.on_new_request(waiting[-1].ctx)
                for r in list(waiting):
                    start = time.monotonic()
                    hit, defer = 0, None
                    for k in r.keys:
                        res = m.lookup(k, r.ctx)
                        if res is LookupResult.MISS:
                            break
                        if res is LookupResult.HIT:
                            hit += 1
                        elif res is LookupResult.HIT_PENDING:
                            hit += 1
                            defer = defer or "hit_pending"
                        else:
                            defer = "retry"
                    if defer is not None:
                        out["deferrals"] += 1
                        out[defer] += 1
                        if r.deferred_since is None:
                            r.deferred_since = start
                        continue
                    if r.deferred_since is not None:
                        out["waits"] += 1
                        out["delay_s"] += time.monotonic() - r.deferred_since
                    if hit:
                        hk = r.keys[:hit]
                        m.prepare_load(hk, r.ctx)
                        m.complete_load(hk, r.ctx)
                    r.hit = hit
                    out["hit_chunks"] += hit
                    waiting.remove(r)
                    running.append(r)
                    r.steps_left = run_steps
                m.on_schedule_end(STEP)
                time.sleep(step_ms / 1000)
        finally:
            view = None
            wait = getattr(m.lookup, "__self__", None)  # kvtiers' promotion wait, where it is on
            if wait is not None and hasattr(wait, "deferred"):
                out["promotion_wait_deferred"] = dict(wait.deferred)
            m.shutdown()
        out["wall_s"] = time.monotonic() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefixes", type=int, default=24)
    ap.add_argument("--per-prefix", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=16, help="chunks per prefix")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rows", type=int, default=48, help="rows of the primary tier (the host arena)")
    ap.add_argument("--step-ms", type=float, default=10.0, help="the forward pass a step stands for")
    ap.add_argument("--retry-wait-ms", type=float, default=None,
                    help="the adapter's retry_wait_ms option (default: the adapter's default)")
    ap.add_argument("--promotion-wait-ms", type=float, default=None,
                    help="kvtiers_promotion_wait_ms (default: the spec's default; 0: vLLM's own behaviour)")
    ap.add_argument("--compare", action="store_true",
                    help="run vLLM's own behaviour (both waits 0) and then this configuration; print the ratios")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.compare:
        off = run(a.prefixes, a.per_prefix, a.chunks, a.concurrency, a.rows, step_ms=a.step_ms,
                  tier_options={"retry_wait_ms": 0}, extra={"kvtiers_promotion_wait_ms": 0})
        print("waits off: " + _line(off))
    opts = {} if a.retry_wait_ms is None else {"retry_wait_ms": a.retry_wait_ms}
    res = run(a.prefixes, a.per_prefix, a.chunks, a.concurrency, a.rows, step_ms=a.step_ms, tier_options=opts,
              extra={} if a.promotion_wait_ms is None else {"kvtiers_promotion_wait_ms": a.promotion_wait_ms})
    if a.json:
        print(json.dumps(res if not a.compare else {"off": off, "on": res}))
        return 0
    print(("waits on:  " if a.compare else "") + _line(res))
    if a.compare:
        print(f"lookup_async_delay {off['delay_s']:.3f} s -> {res['delay_s']:.3f} s "
              f"({off['delay_s'] / max(res['delay_s'], 1e-9):.1f}x); deferred steps {off['deferrals']} -> "
              f"{res['deferrals']} ({off['deferrals'] / max(res['deferrals'], 1):.1f}x); wall "
              f"{off['wall_s']:.2f} s -> {res['wall_s']:.2f} s")
    return 0


def _line(res: dict) -> str:
    return ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items())


if __name__ == "__main__":
    sys.exit(main())
