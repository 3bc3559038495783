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

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is installed by `make test`")

from kvtiers.integrations.vllm import shm_region  # noqa: E402
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


# -- a user who is not root (how vLLM usually runs) ------------------------------------------

USER = "kvtiers-test"

# Run as that user with one capability, to read the interpreter (under a home only root may
# enter), dropped before anything is decided: from then on a plain user's view of /proc.
DROP_CAPS = r'''
import ctypes
class _Hdr(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
assert _libc.capset(ctypes.byref(_Hdr(0x20080522, 0)), (_Data * 2)()) == 0, ctypes.get_errno()
assert all(int(line.split()[1], 16) == 0 for line in open("/proc/self/status") if line.startswith(("CapEff", "CapPrm")))
'''

# engines of that user: the worker's side of engine ``dead`` (killed) and of engine ``live``
# (kvtiers' CPU worker watches it), forked from one process that sweeps when told, as the next
# engine's start would
NON_ROOT = r'''
import json, os, sys, time
from kvtiers.integrations.vllm.shm_region import sweep_stale_regions, watch_region
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
''' + DROP_CAPS + r'''
dead, live, pattern = sys.argv[1:]


def engine(eid, watch):
    pid = os.fork()
    if pid == 0:
        region = SharedOffloadRegion(engine_id=eid, num_chunks=8, rank=0, kv_bytes_per_chunk=8192,
                                     cpu_page_size=8192)
        if watch:
            watch_region(region)
        print(eid, os.getpid(), flush=True)
        time.sleep(300)
        os._exit(0)
    return pid


engine(dead, False)
engine(live, True)
for line in sys.stdin:
    print(json.dumps({"uid": os.getuid(), "removed": sweep_stale_regions(pattern)}), flush=True)
'''

# the next engine's start in another PID namespace sharing /dev/shm (a container): it sees none
# of the engines above
SWEEP_ELSEWHERE = r'''
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("shm_region", sys.argv[1])
shm_region = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shm_region)
''' + DROP_CAPS + r'''
print(json.dumps({"uid": os.getuid(), "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
                  "removed": shm_region.sweep_stale_regions(sys.argv[2])}))
'''


def ended(pid: int) -> None:
    """Wait until process ``pid`` (not ours to reap) is a zombie or gone."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs 60 s after SIGKILL")


def as_user(home: Path) -> tuple[list[str], dict]:
    """The command prefix that runs a process as a user who is not root, and its environment:
    ``USER`` (made with useradd if absent) where this runs as root, else this user itself."""
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    if os.getuid() != 0:
        return [], env
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
                              capture_output=True, text=True)
        assert made.returncode == 0 or "already exists" in made.stderr, made.stderr
    shutil.chown(home, USER, USER)
    return ["setpriv", "--reuid", USER, "--regid", USER, "--clear-groups", "--inh-caps", "+dac_read_search",
            "--ambient-caps", "+dac_read_search", "--"], env


@pytest.fixture(scope="module")
def user_engines():
    """A process of a user who is not root holding the worker's side of engines ``dead`` and
    ``live`` (kvtiers' CPU worker watches ``live``), the pids of both, the glob of their
    regions and the command prefix and environment that run as that user."""
    # not under pytest's directories (the session's TMPDIR), root's alone
    home = Path(tempfile.mkdtemp(prefix="kvtiers-test-home-", dir=os.environ.get("KVTIERS_TESTS_OUTER_TMPDIR")))
    prefix, env = as_user(home)
    tag = uuid.uuid4().hex[:12]
    dead, live = f"kvtiers-shm-{tag}-dead", f"kvtiers-shm-{tag}-live"
    pattern = f"/dev/shm/vllm_offload_kvtiers-shm-{tag}-*.mmap*"
    proc = subprocess.Popen([*prefix, sys.executable, "-c", NON_ROOT, dead, live, pattern], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        pids = {}
        for _ in range(2):
            line = proc.stdout.readline().split()
            assert len(line) == 2, proc.communicate(timeout=30)[1][-3000:]
            pids[line[0]] = int(line[1])
        yield {"proc": proc, "pids": pids, "dead": dead, "live": live, "pattern": pattern, "prefix": prefix,
               "env": env}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        for p in leftovers(dead) + leftovers(live):
            os.unlink(p)
        shutil.rmtree(home, ignore_errors=True)


def test_a_user_who_is_not_root_sweeps_a_killed_engines_region_and_keeps_a_live_ones(user_engines) -> None:
    proc, pids, dead, live = (user_engines[k] for k in ("proc", "pids", "dead", "live"))
    os.kill(pids[dead], signal.SIGKILL)  # killed before anything unlinked its region
    ended(pids[dead])
    assert len(leftovers(dead)) == 1 and len(leftovers(live)) == 1
    assert all(os.stat(p).st_uid != 0 for p in leftovers(dead) + leftovers(live))
    past = time.time() - 120
    for p in leftovers(dead) + leftovers(live):
        os.utime(p, (past, past))

    proc.stdin.write("sweep\n")
    proc.stdin.flush()
    result = json.loads(proc.stdout.readline())
    assert result["uid"] != 0
    assert leftovers(dead) == [] and any(dead in p for p in result["removed"])  # before: "not sweeping ..."
    assert len(leftovers(live)) == 1  # its owner lives: kept


def test_an_engine_in_another_pid_namespace_keeps_a_live_region(user_engines) -> None:
    """The next engine's start in a PID namespace of its own sharing /dev/shm (a container)
    sees none of the processes above, and still keeps the live engine's region (kvtiers'
    worker holds a lock on it)."""
    if os.getuid() != 0:
        pytest.skip("needs root: a PID namespace sharing /dev/shm is made with unshare --pid --mount-proc")
    live = user_engines["live"]
    assert len(leftovers(live)) == 1
    past = time.time() - 120
    for p in leftovers(live):
        os.utime(p, (past, past))  # past the grace period: only the lock keeps it
    other = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", *user_engines["prefix"], sys.executable,
                            "-c", SWEEP_ELSEWHERE, shm_region.__file__, user_engines["pattern"]],
                           env=user_engines["env"], capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr[-3000:]
    seen = json.loads(other.stdout)
    assert seen["uid"] != 0 and seen["pids"] == [1], seen  # itself only
    assert seen["removed"] == [] and len(leftovers(live)) == 1  # kept by kvtiers' worker's flock
