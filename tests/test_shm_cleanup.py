"""No vLLM offload region is left in /dev/shm, however the engine stops.

Real processes with vLLM 0.33's own ``SharedOffloadRegion`` and tiering manager, and
``KvtiersOffloadingSpec`` with kvtiers' CPU worker, in the order vLLM's engine process builds
them (the worker's side first, then the scheduler's): killed with SIGKILL, nothing is left;
regions of engines killed earlier are swept at the next start, regions in use are not.

Each process imports vLLM (slow here), so the module starts its three once, together: an
engine that is killed, also holding the worker's side of another engine's region (the region
left behind); an engine that exits; and a worker's side that stays alive (the region in use).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is installed by `make test`")

from kvtiers.integrations.vllm.shm_region import sweep_stale_regions  # noqa: E402

ENGINE = r'''
import sys, time, uuid
import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                       OffloadingModelConfig, OffloadingParallelConfig)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from kvtiers.integrations.vllm import KvtiersOffloadingSpec

engine_id, what, *also = sys.argv[1:]
PAGE, LAYERS, BPC = 1024, 3, 2
par = OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                               data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                               is_parallelism_agnostic=True)
cfg = OffloadingConfig(
    groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=tuple(f"l{i}" for i in range(LAYERS)), group_id=0),),
    worker_kv_bytes_per_block=LAYERS * PAGE, enable_kv_cache_events=False,
    extra_config={"cpu_bytes_to_use": 8 * 8192, "secondary_tiers": []}, engine_id=engine_id,
    model=OffloadingModelConfig(name="m", dtype="bfloat16"), cache=OffloadingCacheConfig(16, BPC), parallel=par)


def worker_side(eid):  # a worker's side only, as when an engine dies before its scheduler starts
    return SharedOffloadRegion(engine_id=eid, num_chunks=8, rank=0, kv_bytes_per_chunk=8192,
                               cpu_page_size=LAYERS * BPC * PAGE)


if what == "region":
    region = worker_side(engine_id)
else:  # the worker's side (kvtiers' CPU worker), then the scheduler's: what vLLM's engine process does
    kv = [torch.zeros((16, PAGE), dtype=torch.int8) for _ in range(LAYERS)]
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in kv],
                               [[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]])
    worker = KvtiersOffloadingSpec(cfg).get_worker(caches)
    manager = KvtiersOffloadingSpec(cfg).get_manager()
    rows = manager.primary_tier.get_kv_memoryview().cast("B")
    kv[0][5] = 7
    assert worker.submit_store(1, GPULoadStoreSpec([5, 6], [2], [0]), CPULoadStoreSpec([3]))
    # the worker's mapping and the scheduler's are one memory still
    assert bytes(rows[3 * 8192:3 * 8192 + PAGE]) == b"\x07" * PAGE
others = [worker_side(eid) for eid in also]  # other engines' regions this process holds
print("ready", flush=True)
if what == "exit":
    del rows
    manager.shutdown()
    worker.shutdown()
    sys.exit(0)
time.sleep(300)
'''


def leftovers(engine_id: str) -> list[str]:
    return sorted(str(p) for p in Path("/dev/shm").glob(f"vllm_offload_{engine_id}.mmap*"))


def start(*jobs: tuple[str, ...]) -> list[subprocess.Popen]:
    """One process per ``(engine id, what, other engine ids...)``, started together (each
    imports vLLM: slow here), once each has said it is ready."""
    procs = [subprocess.Popen([sys.executable, "-c", ENGINE, *job], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for job in jobs]
    for proc in procs:
        if proc.stdout.readline().strip() != "ready":
            for p in procs:
                p.kill()
            raise AssertionError(f"engine process failed: {proc.communicate(timeout=30)[1][-3000:]}")
    return procs


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def engines():
    """Engine ids (``killed``, ``dead``, ``exits``, ``live``) and the three processes: ``killed``
    (the engine ``killed``, and the worker's side of ``dead``), ``exits`` and ``live``."""
    ids = {k: f"kvtiers-shm-{uuid.uuid4().hex[:12]}" for k in ("killed", "dead", "exits", "live")}
    procs = start((ids["killed"], "kill", ids["dead"]), (ids["exits"], "exit"), (ids["live"], "region"))
    yield ids, dict(zip(("killed", "exits", "live"), procs, strict=True))
    for proc in procs:
        kill(proc)


def test_an_engine_killed_with_sigkill_leaves_no_region_behind_nor_one_that_exits(engines) -> None:
    ids, procs = engines
    killed, exits = ids["killed"], ids["exits"]
    try:
        # worker and scheduler both mapped it: the name is gone already, the memory in use
        assert leftovers(killed) == []
    finally:
        kill(procs["killed"])
    assert leftovers(killed) == []
    clean = procs["exits"]
    _, err = clean.communicate(timeout=60)
    assert clean.returncode == 0, err[-3000:]
    assert leftovers(exits) == []
    assert "Failed to unlink" not in err  # vLLM's clean-up was told the file is gone


def test_stale_regions_are_swept_at_start_and_live_ones_kept(engines) -> None:
    ids, procs = engines
    dead, live = ids["dead"], ids["live"]
    kill(procs["killed"])  # it held dead's region, killed before anything unlinked it: the leak vLLM has today
    try:
        assert len(leftovers(dead)) == 1 and len(leftovers(live)) == 1
        assert sweep_stale_regions() == []  # both younger than the grace period
        past = time.time() - 60
        for p in leftovers(dead) + leftovers(live):
            os.utime(p, (past, past))
        removed = sweep_stale_regions()
        assert leftovers(dead) == [] and any(dead in p for p in removed)
        assert len(leftovers(live)) == 1  # mapped by a live process: kept
    finally:
        kill(procs["live"])
    for p in leftovers(live):
        os.utime(p, (time.time() - 60,) * 2)
    # a new engine's start sweeps it: KvtiersOffloadingSpec's scheduler side, in this process
    ns: dict = {}
    new_id = f"kvtiers-shm-{uuid.uuid4().hex[:12]}"
    exec(ENGINE.split("if what ==")[0].replace("engine_id, what, *also = sys.argv[1:]",
                                              f"engine_id, what, also = {new_id!r}, '', []"), ns)
    manager = ns["KvtiersOffloadingSpec"](ns["cfg"]).get_manager()
    manager.shutdown()
    assert leftovers(live) == []
