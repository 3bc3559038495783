"""The kvtiers L2 adapter against LMCache's real classes (lmcache 0.5.6 in ``.venv-lmcache``,
and 0.5.7 from build/lmcache-0.5.7 put first on ``PYTHONPATH``: every case runs on both).

LMCache lives in its own environment, so the cases run in one process of it (this file,
run as a script: ``python tests/test_lmcache_adapter.py OUT.json``), each through LMCache's
own plugin factory (``create_l2_adapter`` with the documented ``--l2-adapter`` JSON), its
``TensorMemoryObj`` objects in a torch buffer described by an ``L1MemoryDesc``, its eventfds
and ``Bitmap``s, on real kvtiers tiers over real files; the tests here read what each case
saw. LMCache's own check for L2 adapters (``lmcache.v1.basic_check --mode test_l2_adapter``,
the only one it ships that runs on CPU) runs against the adapter too. The package's
LMCache-free parts (params, keys, the missing-LMCache line) are tested in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
LMCACHE_PY = Path(os.environ.get("KVTIERS_LMCACHE_PYTHON", ROOT / ".venv-lmcache" / "bin" / "python"))
NEXT = ROOT / "build" / "lmcache-0.5.7"  # make test installs it (--no-deps --target)
needs_lmcache = pytest.mark.skipif(
    not (LMCACHE_PY.exists() and (LMCACHE_PY.parent.parent / ".installed").exists()),
    reason=f"LMCache's environment {LMCACHE_PY.parent.parent} is not built: make .venv-lmcache/.installed "
           f"(make test does)",
)

MODEL = "org/tiny-model"
OBJ = 64 << 10  # bytes per object: 16 pages
N = 8


# --- the cases, run in LMCache's environment --------------------------------------------------

def _plugin(params: dict[str, Any]) -> dict[str, Any]:
    return {"type": "plugin", "module_path": "kvtiers.integrations.lmcache", "class_name": "KvtiersL2Adapter",
            "config_class_name": "KvtiersL2AdapterConfig", "adapter_params": params}


class _Bench:
    """An L1 buffer of 4 * N objects, LMCache's memory objects in it, and an adapter made
    by LMCache's factory from the plugin JSON."""

    def __init__(self, params: dict[str, Any], *, l1: bool = True, offset: int = 0) -> None:
        import torch
        from lmcache.v1.distributed.internal_api import L1MemoryDesc
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase, get_l2_adapter_config_class

        self.torch = torch
        self.buf = torch.zeros(4 * N * OBJ + offset, dtype=torch.uint8)
        # objects start ``offset`` bytes into the region: off its page grid unless 0
        desc = L1MemoryDesc(ptr=self.buf.data_ptr(), size=4 * N * OBJ, align_bytes=4096) if l1 else None
        spec = _plugin(params)
        cfg: L2AdapterConfigBase = get_l2_adapter_config_class("plugin").from_dict(spec)
        self.adapter = create_l2_adapter(cfg, l1_memory_desc=desc)
        self.offset = offset

    def obj(self, i: int, fill: int | None = None) -> Any:
        """LMCache's memory object in slot ``i`` of the buffer (filled with a pattern of ``fill``)."""
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

        torch = self.torch
        raw = self.buf[self.offset + i * OBJ: self.offset + (i + 1) * OBJ]
        if fill is not None:
            raw.copy_((torch.arange(OBJ, dtype=torch.int64) * (fill + 1) + fill).to(torch.uint8))
        view = raw.view(torch.bfloat16)
        meta = MemoryObjMetadata(shape=torch.Size([2, OBJ // 4]), dtype=torch.bfloat16, address=raw.data_ptr(),
                                 phy_size=OBJ, fmt=MemoryFormat.KV_2LTD, ref_count=1)
        return TensorMemoryObj(view, meta, parent_allocator=None)

    def wait(self, efd: int) -> None:
        import select

        from lmcache.v1.platform import consume_fd

        p = select.poll()
        p.register(efd, select.POLLIN)
        if not p.poll(60_000):
            raise TimeoutError("no event within 60 s")
        consume_fd(efd)

    def store(self, keys: list[Any], objs: list[Any]) -> Any:
        a = self.adapter
        tid = a.submit_store_task(keys, objs)
        while True:
            self.wait(a.get_store_event_fd())
            done = a.pop_completed_store_tasks()
            if tid in done:
                return done[tid]

    def lookup(self, keys: list[Any], layouts: dict | None = None) -> list[int]:
        from lmcache.v1.distributed.api import MemoryLayoutDesc

        a = self.adapter
        descs = {0: MemoryLayoutDesc([self.torch.Size([2, OBJ // 4])], [self.torch.bfloat16])} if layouts is None \
            else layouts
        tid = a.submit_lookup_and_lock_task(keys, descs)
        return self.bits(a.get_lookup_and_lock_event_fd(), a.query_lookup_and_lock_result, tid, len(keys))

    def load(self, keys: list[Any], objs: list[Any]) -> list[int]:
        a = self.adapter
        return self.bits(a.get_load_event_fd(), a.query_load_result, a.submit_load_task(keys, objs), len(keys))

    def bits(self, efd: int, query: Any, tid: Any, n: int) -> list[int]:
        """Wait on ``efd`` until ``query(tid)`` gives the task's bitmap; its first ``n`` bits."""
        while True:
            self.wait(efd)
            bm = query(tid)
            if bm is not None:
                return [int(bm.test(i)) for i in range(n)]

    def raw(self, i: int) -> Any:
        return self.buf[self.offset + i * OBJ: self.offset + (i + 1) * OBJ]

    def same(self, i: int, j: int) -> bool:
        """Objects ``i`` and ``j`` hold the same bytes (and not all zeros)."""
        return bool(self.torch.equal(self.raw(i), self.raw(j))) and bool(self.raw(i).any())


def _keys(prefix: str, n: int = N, salt: str = "", model: str = MODEL, rank: int = 0) -> list[Any]:
    import hashlib

    from lmcache.v1.distributed.api import ObjectKey

    return [ObjectKey(hashlib.sha256(f"{prefix}{i}".encode()).digest(), model, rank, 0, salt) for i in range(n)]


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.bin"))


def case_roundtrip(tmp: Path) -> dict[str, Any]:
    """Store, lookup-and-lock, load, unlock through LMCache's interface on a real fs tier."""
    b = _Bench({"tier": {"type": "fs", "root_dir": str(tmp / "kv")}})
    keys = _keys("chunk")
    out: dict[str, Any] = {"absent": b.lookup(keys)}
    res = b.store(keys, [b.obj(i, fill=i) for i in range(N)])
    out.update(store_ok=res.is_successful(), store_bytes=res.bytes_transferred(), files=len(_files(tmp / "kv")))
    out["lookup"] = b.lookup(keys)
    out["locked"] = b.adapter.locked()
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    out["placeholder_lookup"] = b.lookup(keys[:2], layouts={0: MemoryLayoutDesc([], [])})  # LMCache's bench l2
    b.adapter.submit_unlock(keys[:2])
    out["load"] = b.load(keys, [b.obj(N + i) for i in range(N)])
    out["equal"] = [b.same(i, N + i) for i in range(N)]
    b.adapter.submit_unlock(keys)
    out["locked_after_unlock"] = b.adapter.locked()
    mixed = [keys[0], *_keys("never", 2), keys[3]]
    out["mixed_lookup"] = b.lookup(mixed)
    out["mixed_load"] = b.load(mixed, [b.obj(2 * N + i) for i in range(4)])
    out["other_rank"] = b.lookup(_keys("chunk", rank=0x1000100))
    out["other_model"] = b.lookup(_keys("chunk", model="org/other-model"))
    out["status"] = b.adapter.report_status()
    out["usage"] = b.adapter.get_usage().total_bytes_used
    b.adapter.close()
    # a new adapter (a restarted server): knows nothing, finds everything on the medium
    b2 = _Bench({"tier": {"type": "fs", "root_dir": str(tmp / "kv")}, "zero_copy": False})
    out["reopen_lookup"] = b2.lookup(keys)
    out["reopen_load"] = b2.load(keys, [b2.obj(N + i) for i in range(N)])
    b2.obj(0, fill=0)
    out["reopen_equal"] = [b2.same(0, N)]
    out["reopen_status"] = b2.adapter.report_status()
    b2.adapter.close()
    return out


def case_staged(tmp: Path) -> dict[str, Any]:
    """No L1 region, or objects off its page grid with zero_copy false: staged, intact. Off
    the grid with zero_copy null (the default): each such object staged, intact. Off the grid
    with zero_copy true: refused (failed store, misses), never wrong bytes."""
    out: dict[str, Any] = {}
    for name, params, kw in (("no_l1", {}, {"l1": False}), ("off_grid", {"zero_copy": False}, {"offset": 64}),
                             ("off_grid_null", {}, {"offset": 64}),
                             ("off_grid_zero_copy", {"zero_copy": True}, {"offset": 64})):
        b = _Bench({"tier": {"type": "fs", "root_dir": str(tmp / name)}, "staging_slots": 3, **params}, **kw)
        keys = _keys(name)
        res = b.store(keys, [b.obj(i, fill=i + 3) for i in range(N)])  # 8 objects through 3 staging slots
        out[name] = {"store_ok": res.is_successful(), "load": b.load(keys, [b.obj(N + i) for i in range(N)]),
                     "equal": [b.same(i, N + i) for i in range(N)], "untouched": not b.raw(N).any(),
                     "status": b.adapter.report_status()}
        b.adapter.close()
    return out


def case_corrupt(tmp: Path) -> dict[str, Any]:
    """A chunk damaged on disk (the fs tier's own conformance_corrupt) is a miss, the rest intact."""
    from kvtiers_fs import FsTier

    from kvtiers import Namespace
    from kvtiers.integrations.lmcache import Layout, Space, tier_key_of

    cfg = {"root_dir": str(tmp / "kv")}
    b = _Bench({"tier": {"type": "fs", **cfg}})
    keys = _keys("c")
    assert b.store(keys, [b.obj(i, fill=i) for i in range(N)]).is_successful()
    space = Space(MODEL, 0, 0, Layout.of([[2, OBJ // 4]], [b.torch.bfloat16]))
    FsTier.conformance_corrupt(cfg, Namespace(space.fields()), tier_key_of(keys[2].chunk_hash, ""))
    out = {"load": b.load(keys, [b.obj(N + i) for i in range(N)])}
    out["equal"] = [b.same(i, N + i) for i in range(N)]
    out["status"] = b.adapter.report_status()
    b.adapter.close()
    return out


def case_encrypted(tmp: Path) -> dict[str, Any]:
    """An encrypted fs tier with tenant keys: cache_salt is the tenant."""
    for name in ("default", "alice"):
        (tmp / f"{name}.key").write_bytes(os.urandom(32))
    enc = {"key_file": str(tmp / "default.key"), "key_id": "dflt",
           "tenants": {"alice": {"key_file": str(tmp / "alice.key"), "key_id": "alice-1"}}, "unknown_tenant": "skip"}
    root = tmp / "kv"
    b = _Bench({"tier": {"type": "fs", "root_dir": str(root), "encrypt": enc}})
    plain, alice, bob = _keys("p", 2), _keys("a", 2, salt="alice"), _keys("b", 2, salt="bob")
    out: dict[str, Any] = {
        "store_plain": b.store(plain, [b.obj(0, fill=1), b.obj(1, fill=2)]).is_successful(),
        "store_alice": b.store(alice, [b.obj(2, fill=3), b.obj(3, fill=4)]).is_successful(),
        "store_bob": b.store(bob, [b.obj(4, fill=5), b.obj(5, fill=6)]).is_successful(),  # no key: not stored
    }
    out["lookup"] = b.lookup(plain + alice + bob)
    out["load_alice"] = b.load(alice, [b.obj(N), b.obj(N + 1)])
    out["equal_alice"] = [b.same(2, N), b.same(3, N + 1)]
    out["load_plain"] = b.load(plain, [b.obj(N + 2), b.obj(N + 3)])
    out["equal_plain"] = [b.same(0, N + 2), b.same(1, N + 3)]
    # alice's chunk asked for as another tenant's (same hash, other salt): another key, a miss
    stolen = _keys("a", 2, salt="mallory")
    out["lookup_as_other"] = b.lookup(stolen)
    pattern = bytes(b.raw(2)[:4096].numpy())
    out["plaintext_on_disk"] = any(pattern in p.read_bytes() for p in _files(root))
    out["files"] = len(_files(root))
    b.adapter.close()
    return out


def case_sqlite(tmp: Path) -> dict[str, Any]:
    """The third-party example tier (kvtiers-sqlite) behind the same adapter."""
    b = _Bench({"tier": {"type": "sqlite", "path": str(tmp / "kv.db")}})
    keys = _keys("s", 4)
    out = {"store_ok": b.store(keys, [b.obj(i, fill=i + 7) for i in range(4)]).is_successful(),
           "lookup": b.lookup(keys), "load": b.load(keys, [b.obj(N + i) for i in range(4)])}
    out["equal"] = [b.same(i, N + i) for i in range(4)]
    b.adapter.close()
    return out


def case_failures(tmp: Path) -> dict[str, Any]:
    """A tier that cannot open, bad calls: misses and failed stores, no exception."""
    (tmp / "a-file").write_text("not a directory")
    b = _Bench({"tier": {"type": "fs", "root_dir": str(tmp / "a-file" / "kv")}})
    keys = _keys("f", 2)
    out: dict[str, Any] = {"store_ok": b.store(keys, [b.obj(0, fill=1), b.obj(1, fill=2)]).is_successful()}
    out["lookup"] = b.lookup(keys)
    out["load"] = b.load(keys, [b.obj(2), b.obj(3)])
    out["mismatched_store"] = b.store(keys, [b.obj(0)]).is_successful()
    out["unknown_layout_lookup"] = b.lookup(_keys("f", 2, model="org/never-stored"), layouts={})
    out["status"] = b.adapter.report_status()
    b.adapter.close()
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class

    try:  # a bad tier entry: LMCache's config parsing fails with kvtiers' one line, at start-up
        get_l2_adapter_config_class("plugin").from_dict(_plugin({"tier": {"type": "fs"}}))
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter

        create_l2_adapter(get_l2_adapter_config_class("plugin").from_dict(_plugin({"tier": {"type": "fs"}})))
    except Exception as e:
        out["bad_config"] = f"{type(e).__name__}: {e}"
    return out


def case_lmcache_check(tmp: Path) -> dict[str, Any]:
    """LMCache's own L2 adapter check (``test_l2_adapter`` mode of ``lmcache.v1.basic_check``)."""
    import asyncio
    import contextlib
    import io

    try:
        from lmcache.v1.check import registry
    except ModuleNotFoundError:  # LMCache 0.5.7 moved the in-process mode under lmcache/inprocess/
        from lmcache.inprocess.v1.check import registry

    spec = json.dumps(_plugin({"tier": {"type": "fs", "root_dir": str(tmp / "kv")}}))
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        asyncio.run(registry.get_mode("test_l2_adapter")(model=MODEL, l2_adapter=[spec], num_keys=8))
    return {"output": text.getvalue()}


def case_lmcache_bench_l2(tmp: Path) -> dict[str, Any]:
    """LMCache's L2 adapter bench (``lmcache bench l2``), round-trip verification on, every
    key looked up after it was stored."""
    spec = json.dumps(_plugin({"tier": {"type": "fs", "root_dir": str(tmp / "kv")}}))
    proc = subprocess.run([str(Path(sys.executable).with_name("lmcache")), "bench", "l2", "--l2-adapter", spec,
                           "--rounds", "1", "--num-keys", "8", "--no-skip-verify", "--lookup-max-hit-rate", "1.0"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
    return {"rc": proc.returncode, "output": proc.stdout}


def case_release(tmp: Path) -> dict[str, Any]:
    """Which LMCache this is; the adapter is built by its factory (0.5.7: get_memory_tags is
    abstract) and says what each tier is."""
    import lmcache
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface

    out: dict[str, Any] = {"version": getattr(lmcache, "__version__", "?"),
                           "abstract": sorted(L2AdapterInterface.__abstractmethods__)}
    tags = {}
    for name, params in (("fs", {"tier": {"type": "fs", "root_dir": str(tmp / "kv")}}),
                         ("memory", {"tier": {"type": "memory"}}),
                         ("fs_said_remote", {"tier": {"type": "fs", "root_dir": str(tmp / "kv")},
                                             "residency": "remote"}),
                         ("sqlite", {"tier": {"type": "sqlite", "path": str(tmp / "kv.db")}})):
        b = _Bench(params)
        if "get_memory_tags" in out["abstract"]:
            t = b.adapter.get_memory_tags()
            tags[name] = [t.segment.value, t.residency.value]
        b.adapter.close()
    out["tags"] = tags
    return out


def case_touch_delete(tmp: Path) -> dict[str, Any]:
    """A memory tier bounded to 4 objects: a touched object outlives a newer untouched one;
    LMCache's delete forgets keys in its byte count; /status counts both from 0."""
    b = _Bench({"tier": {"type": "memory", "max_bytes": 4 * OBJ}})
    out: dict[str, Any] = {"status_before": b.adapter.report_status()}
    keys = _keys("t", 5)
    for i in range(4):
        assert b.store(keys[i:i + 1], [b.obj(i, fill=i)]).is_successful()
    b.adapter.submit_touch(keys[:1])  # k0 is the oldest: touched, it is not the one evicted next
    import time

    deadline = time.monotonic() + 30
    while b.adapter.report_status()["touched"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.store(keys[4:], [b.obj(4, fill=4)]).is_successful()
    out["lookup"] = b.lookup(keys)
    b.adapter.submit_unlock([k for k, hit in zip(keys, out["lookup"], strict=True) if hit])
    out["usage_before"] = b.adapter.get_usage().total_bytes_used
    b.adapter.delete(keys[2:4])
    out["usage_after"] = b.adapter.get_usage().total_bytes_used
    out["status"] = b.adapter.report_status()
    b.adapter.close()
    return out


def case_namespace(tmp: Path) -> dict[str, Any]:
    """adapter_params.namespace: two deployments on one fs root never see each other's chunks."""
    root = str(tmp / "kv")
    a = _Bench({"tier": {"type": "fs", "root_dir": root}, "namespace": {"deployment": "a"}})
    keys = _keys("n", 4)
    assert a.store(keys, [a.obj(i, fill=i) for i in range(4)]).is_successful()
    a.adapter.close()
    out = {}
    for name, ns in (("same", {"deployment": "a"}), ("other", {"deployment": "b"}), ("none", None)):
        params: dict[str, Any] = {"tier": {"type": "fs", "root_dir": root}}
        if ns is not None:
            params["namespace"] = ns
        b = _Bench(params)
        out[name] = b.lookup(keys)
        b.adapter.close()
    out["dirs"] = len([p for p in Path(root).iterdir() if p.is_dir()])
    return out


def case_zero_copy_true(tmp: Path) -> dict[str, Any]:
    """zero_copy true: in place on L1's grid, every byte; with no L1 region it is refused."""
    b = _Bench({"tier": {"type": "fs", "root_dir": str(tmp / "kv")}, "zero_copy": True})
    keys = _keys("z", 4)
    out: dict[str, Any] = {"store_ok": b.store(keys, [b.obj(i, fill=i + 1) for i in range(4)]).is_successful()}
    out["load"] = b.load(keys, [b.obj(N + i) for i in range(4)])
    out["equal"] = [b.same(i, N + i) for i in range(4)]
    out["status"] = b.adapter.report_status()
    b.adapter.close()
    c = _Bench({"tier": {"type": "fs", "root_dir": str(tmp / "kv2")}, "zero_copy": True}, l1=False)
    out["no_l1_store_ok"] = c.store(keys, [c.obj(i, fill=i + 1) for i in range(4)]).is_successful()
    out["no_l1_status"] = c.adapter.report_status()
    c.adapter.close()
    return out


def case_p2p(tmp: Path) -> dict[str, Any]:
    """The p2p tier (a `kvtiers p2p serve` peer the test started) behind the adapter: another
    host's memory, so REMOTE; a second adapter (another LMCache server) finds the chunks."""
    port = os.environ.get("KVTIERS_TEST_P2P_PORT")
    if not port:
        return {"skipped": "no p2p server"}
    tier = {"type": "p2p", "host": "127.0.0.1", "port": int(port)}
    b = _Bench({"tier": tier, "namespace": {"deployment": tmp.name + str(os.getpid())}})
    keys = _keys("p", 4)
    out: dict[str, Any] = {"store_ok": b.store(keys, [b.obj(i, fill=i + 9) for i in range(4)]).is_successful()}
    out["lookup"] = b.lookup(keys)
    try:
        t = b.adapter.get_memory_tags()
        out["tags"] = [t.segment.value, t.residency.value]
    except ImportError:  # 0.5.6: no MemoryTags
        out["tags"] = None
    b.adapter.close()
    c = _Bench({"tier": tier, "namespace": {"deployment": tmp.name + str(os.getpid())}})
    out["other_lookup"] = c.lookup(keys)
    out["other_load"] = c.load(keys, [c.obj(N + i) for i in range(4)])
    for i in range(4):
        c.obj(i, fill=i + 9)
    out["equal"] = [c.same(i, N + i) for i in range(4)]
    c.adapter.close()
    return out


CASES = {name[5:]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}


def main(out_file: str, scratch: str) -> None:
    import logging
    import traceback

    logging.disable(logging.WARNING)
    results: dict[str, Any] = {}
    for name, fn in CASES.items():
        d = Path(scratch) / name
        d.mkdir(parents=True)
        try:
            results[name] = {"ok": fn(d)}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    Path(out_file).write_text(json.dumps(results, default=str))


# --- the tests ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def p2p_port():
    """A `kvtiers p2p serve` peer for the p2p case, or None where kvtiers' p2p tier is missing."""
    try:
        from kvtiers_p2p.spawn import start_server
    except ImportError:
        yield None
        return
    srv = start_server(capacity=64 << 20)
    yield srv.port
    srv.stop()


@pytest.fixture(scope="module", params=["0.5.6", "0.5.7"])
def cases(request, tmp_path_factory, p2p_port) -> dict[str, Any]:
    """Every case, run once in LMCache's environment per release (0.5.7: build/lmcache-0.5.7)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if p2p_port is not None:
        env["KVTIERS_TEST_P2P_PORT"] = str(p2p_port)
    if request.param == "0.5.7":
        if not (NEXT / ".installed").exists():
            pytest.skip(f"LMCache 0.5.7 is not in {NEXT.relative_to(ROOT)} (make test installs it)")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(NEXT), os.environ.get("PYTHONPATH")]))
    tmp = tmp_path_factory.mktemp("lmcache-adapter")
    out = tmp / "out.json"
    proc = subprocess.run([str(LMCACHE_PY), __file__, str(out), str(tmp / "scratch")], capture_output=True,
                          text=True, timeout=600, env=env)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"the LMCache cases exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def result(cases: dict[str, Any], name: str) -> dict[str, Any]:
    r = cases[name]
    assert "error" not in r, r.get("error")
    return r["ok"]


@needs_lmcache
def test_roundtrip_through_lmcache_interface(cases):
    r = result(cases, "roundtrip")
    assert r["absent"] == [0] * N  # nothing stored yet
    assert r["store_ok"] and r["store_bytes"] == N * OBJ and r["files"] == N
    assert r["lookup"] == [1] * N and r["locked"] == N
    assert r["placeholder_lookup"] == [1, 1]  # an empty layout hint: the layout this adapter stored with
    assert r["load"] == [1] * N and all(r["equal"])
    assert r["locked_after_unlock"] == 0
    assert r["mixed_lookup"] == [1, 0, 0, 1] and r["mixed_load"] == [1, 0, 0, 1]
    assert r["other_rank"] == [0] * N and r["other_model"] == [0] * N  # namespaces never mix
    assert r["status"]["stored"] == N and r["status"]["loaded"] == N + 2
    # one namespace per model and rank asked about, each on the page grid of L1
    assert list(r["status"]["namespaces"].values()) == ["zero-copy"] * 3
    assert r["usage"] == N * OBJ  # LMCache's byte accounting sees what was stored


@needs_lmcache
def test_new_adapter_finds_chunks_on_the_medium(cases):
    r = result(cases, "roundtrip")
    assert r["reopen_lookup"] == [1] * N and r["reopen_load"] == [1] * N and r["reopen_equal"] == [True]
    assert list(r["reopen_status"]["namespaces"].values()) == ["staged"]  # zero_copy false: same chunks


@needs_lmcache
def test_staged_when_no_l1_or_off_grid(cases):
    r = result(cases, "staged")
    for name in ("no_l1", "off_grid"):
        assert r[name]["store_ok"] and r[name]["load"] == [1] * N and all(r[name]["equal"]), name
        assert list(r[name]["status"]["namespaces"].values()) == ["staged"], name
    n = r["off_grid_null"]  # the grid's namespace, objects off it: each one through staging, intact
    assert n["store_ok"] and n["load"] == [1] * N and all(n["equal"]), n
    assert list(n["status"]["namespaces"].values()) == ["zero-copy, off-grid objects staged"]
    assert n["status"]["off_grid"] == 2 * N
    z = r["off_grid_zero_copy"]  # zero_copy true, objects off the grid: refused, never wrong bytes
    assert not z["store_ok"] and z["load"] == [0] * N and z["untouched"] and z["status"]["off_grid"] == 2 * N


@needs_lmcache
def test_corrupt_chunk_is_a_miss(cases):
    r = result(cases, "corrupt")
    assert r["load"] == [1, 1, 0, 1, 1, 1, 1, 1]
    assert [e for i, e in enumerate(r["equal"]) if i != 2] == [True] * (N - 1)
    assert r["status"]["failed_keys"] == 1


@needs_lmcache
def test_encrypted_tier_with_cache_salt_tenants(cases):
    r = result(cases, "encrypted")
    assert r["store_plain"] and r["store_alice"] and not r["store_bob"]  # bob has no key: not offloaded
    assert r["lookup"] == [1, 1, 1, 1, 0, 0]
    assert r["load_alice"] == [1, 1] and r["equal_alice"] == [True, True]
    assert r["load_plain"] == [1, 1] and r["equal_plain"] == [True, True]
    assert r["lookup_as_other"] == [0, 0]
    assert r["files"] == 4 and not r["plaintext_on_disk"]


@needs_lmcache
def test_third_party_tier(cases):
    r = result(cases, "sqlite")
    assert r["store_ok"] and r["lookup"] == [1] * 4 and r["load"] == [1] * 4 and all(r["equal"])


@needs_lmcache
def test_failures_are_misses_never_exceptions(cases):
    r = result(cases, "failures")
    assert not r["store_ok"] and r["lookup"] == [0, 0] and r["load"] == [0, 0]
    assert not r["mismatched_store"] and r["unknown_layout_lookup"] == [0, 0]
    assert r["status"]["open_failed"] >= 1 and r["status"]["is_healthy"]
    assert "missing required option 'root_dir'" in r["bad_config"]


@needs_lmcache
def test_lmcache_own_l2_adapter_check(cases):
    out = result(cases, "lmcache_check")["output"]
    assert "KvtiersL2Adapter" in out and "Test Failed" not in out, out
    for line in ("8/8 correctly absent", "Batch store OK", "8/8 found", "Validation (loaded): 8/8",
                 "Validation (content): 8/8"):
        assert line in out, out


@needs_lmcache
def test_lmcache_own_l2_adapter_bench_verifies(cases):
    r = result(cases, "lmcache_bench_l2")
    out = r["output"]
    assert r["rc"] == 0 and "All 8 keys data verified OK" in out, out
    successes = [line.split()[-1] for line in out.splitlines() if line.startswith("Total success:")]
    assert successes == ["8", "8", "8"], out  # store, lookup, load


@needs_lmcache
def test_each_release_builds_the_adapter(cases, request):
    r = result(cases, "release")
    release = request.node.callspec.params["cases"]
    assert r["version"].startswith(release), r["version"]
    if release == "0.5.7":  # 0.5.7 made get_memory_tags abstract: the adapter answers it
        assert "get_memory_tags" in r["abstract"]
        assert r["tags"] == {"fs": ["storage", "local"], "memory": ["dram", "local"],
                             "fs_said_remote": ["storage", "remote"], "sqlite": ["storage", "remote"]}


@needs_lmcache
def test_touch_keeps_a_chunk_and_delete_leaves_lmcaches_count(cases):
    r = result(cases, "touch_delete")
    before = r["status_before"]
    for k in ("stored", "loaded", "lookup_hits", "touched", "deleted", "evicted", "failed_keys", "off_grid",
              "open_failed"):
        assert before[k] == 0, k  # /status reports every counter from the start
    assert r["lookup"] == [1, 0, 1, 1, 1]  # k1 evicted by the bound; k0, touched, kept
    assert r["status"]["touched"] == 1 and r["status"]["evicted"] == 1
    assert r["usage_before"] - r["usage_after"] == 2 * OBJ and r["status"]["deleted"] == 2


@needs_lmcache
def test_namespace_param_keeps_deployments_apart(cases):
    r = result(cases, "namespace")
    assert r["same"] == [1] * 4
    assert r["other"] == [0] * 4 and r["none"] == [0] * 4  # another namespace: never the other's chunks
    assert r["dirs"] == 3  # a directory per namespace: "a", "b" and none


@needs_lmcache
def test_zero_copy_true(cases):
    r = result(cases, "zero_copy_true")
    assert r["store_ok"] and r["load"] == [1] * 4 and all(r["equal"])
    assert list(r["status"]["namespaces"].values()) == ["zero-copy"]
    assert not r["no_l1_store_ok"] and r["no_l1_status"]["open_failed"] >= 1  # required, impossible: refused


@needs_lmcache
def test_p2p_tier_behind_the_adapter(cases, p2p_port):
    if p2p_port is None:
        pytest.skip("kvtiers' p2p tier is not installed here: pip install 'kvtiers[p2p]'")
    r = result(cases, "p2p")
    assert r["store_ok"] and r["lookup"] == [1] * 4
    assert r["other_lookup"] == [1] * 4 and r["other_load"] == [1] * 4 and all(r["equal"])
    assert r["tags"] in (None, ["dram", "remote"])


@needs_lmcache
def test_the_docs_install_line_installs_kvtiers_from_the_checkout():
    """docs/lmcache.md's pip line, with the checkout's path for ``./kvtiers``, resolved by pip in
    LMCache's environment (offline: what it needs is there): it installs kvtiers from the
    checkout, not a name no index has."""
    import re
    import shlex

    text = (ROOT / "docs" / "lmcache.md").read_text()
    (line,) = [m for m in re.findall(r"^pip install .*$", text, re.M) if "lmcache==0.5.6" in m]
    args = shlex.split(line)[2:]
    args = [str(ROOT) if a == "./kvtiers" else a for a in args]
    if "--extra-index-url" in args:
        i = args.index("--extra-index-url")
        del args[i:i + 2]
    pip = LMCACHE_PY.with_name("pip")
    out = subprocess.run([str(pip), "install", "--dry-run", "--no-index", "--no-build-isolation", *args],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Would install kvtiers-" in out.stdout, out.stdout[-2000:]


@needs_lmcache
def test_the_adapters_log_lines_reach_lmcaches_log(tmp_path):
    """As in ``lmcache server``: logging configured by LMCache only; the adapter's INFO lines
    (and its tier's) come out on stderr with LMCache's own. (On 0.5.6: ``lmcache/logging.py``
    is the same file in 0.5.7.)"""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("LMCACHE_LOG_LEVEL", None)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_lmcache_adapter as t; from pathlib import Path\n"
            "b = t._Bench({'tier': {'type': 'fs', 'root_dir': sys.argv[2]}})\n"
            "assert b.store(t._keys('log', 1), [b.obj(0, fill=1)]).is_successful()\n"
            "b.adapter.close()\n")
    out = subprocess.run([str(LMCACHE_PY), "-c", code, str(ROOT / "tests"), str(tmp_path / "kv")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    for line in ("kvtiers L2 adapter: tier 'fs'", "on tier 'fs', zero-copy", "kvtiers L2 adapter closed"):
        assert line in out.stderr, out.stderr[-3000:]


def test_memory_tags_without_lmcache(tmp_path):
    from kvtiers.integrations.lmcache.tags import fs_type, is_shared_fs, memory_tags

    assert fs_type("/proc/self") == "proc"
    assert [is_shared_fs(t) for t in ("nfs4", "cifs", "fuse.sshfs", "lustre", "ext4", "xfs", "tmpfs", None)] == \
        [True, True, True, True, False, False, False, False]
    local = memory_tags("fs", {"root_dir": str(tmp_path / "not-made-yet")})
    assert local == (("storage", "remote") if is_shared_fs(fs_type(str(tmp_path))) else ("storage", "local"))
    assert memory_tags("obj", {}) == ("storage", "remote") and memory_tags("p2p", {}) == ("dram", "remote")
    assert memory_tags("pkg.mod:Tier", {}) == ("storage", "remote")  # unknown: never LOCAL
    assert memory_tags("fs", {"root_dir": "/"}, "remote") == ("storage", "remote")


def test_params_and_keys_without_lmcache():
    from kvtiers.errors import ConfigError
    from kvtiers.integrations.lmcache import parse_params, tier_key_of

    p = parse_params({"tier": {"type": "fs", "root_dir": "/x", "encrypt": {"key_env": "K"}}, "zero_copy": False})
    assert p.tier_type == "fs" and p.encrypted and p.zero_copy is False
    for bad, says in (({"tier": {"type": "nope"}}, "unknown tier type 'nope'"),
                      ({"tier": {"type": "fs", "root": "/x"}}, "unknown option 'root'"),
                      ({"tier": {"type": "fs", "root_dir": "/x"}, "staging_slots": 0}, "staging_slots"),
                      ({"tier": {"type": "fs", "root_dir": "/x"}, "extra": 1}, "unknown adapter_params key 'extra'"),
                      ({"tier": {"type": "fs", "root_dir": "/x", "admit": {"min_offers": 2}}},
                       "option 'admit' is not applied .*LMCache"),  # the manager's cascade only: not ignored
                      ({}, "needs \"tier\"")):
        with pytest.raises(ConfigError, match=says):
            parse_params(bad)
    h = b"\x01" * 32
    assert tier_key_of(h, "") == h
    assert len({tier_key_of(h, "a"), tier_key_of(h, "b"), tier_key_of(h, "")}) == 3


def test_missing_lmcache_is_one_line():
    code = ("import sys\nclass B:\n def find_spec(self, n, p=None, t=None):\n"
            "  if n == 'lmcache' or n.startswith('lmcache.'): raise ModuleNotFoundError(n, name=n)\n"
            "sys.meta_path.insert(0, B())\nimport kvtiers.integrations.lmcache as m\n"
            "try:\n m.KvtiersL2Adapter\nexcept ImportError as e:\n print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.count("\n") == 1, out.stderr
    assert "needs LMCache" in out.stdout and "pip install lmcache==0.5.6" in out.stdout


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
