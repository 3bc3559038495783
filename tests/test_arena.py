"""Host arena: sizing, plain memory, shortfalls, shared memory across processes, elastic pages."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from kvtiers import Arena, ConfigError
from kvtiers.engine import arena as arena_mod
from kvtiers.engine.arena import ArenaSpaceError, arena_size, create_host_arena, slot_bytes_for

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


@pytest.fixture
def shm_name():
    name = f"kvtiers-test-{uuid.uuid4().hex[:12]}"
    yield name
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


def test_slot_bytes_are_padded_to_pages():
    assert slot_bytes_for(1) == 4096
    assert slot_bytes_for(4096) == 4096
    assert slot_bytes_for(4097) == 8192
    assert slot_bytes_for(3 * MiB + 5) == 3 * MiB + 4096
    with pytest.raises(ValueError):
        slot_bytes_for(0)


def test_arena_size_by_bytes_over_workers_and_by_factor():
    assert arena_size(64 * MiB, MiB) == 64
    assert arena_size(64 * MiB, MiB, num_workers=4) == 16  # host_bytes is the total, as in vLLM
    assert arena_size(64 * MiB + 5, MiB, num_workers=4) == 16
    assert arena_size(None, MiB, host_blocks_factor=2.5, device_chunk_capacity=100) == 250
    with pytest.raises(ConfigError, match="exactly one"):
        arena_size(64 * MiB, MiB, host_blocks_factor=2.0, device_chunk_capacity=10)
    with pytest.raises(ConfigError, match="exactly one"):
        arena_size(None, MiB)
    with pytest.raises(ConfigError, match="less than one slot"):
        arena_size(3 * MiB, MiB, num_workers=4)
    with pytest.raises(ConfigError, match="device_chunk_capacity"):
        arena_size(None, MiB, host_blocks_factor=2.0)
    with pytest.raises(ConfigError, match="multiple of 4096"):
        arena_size(MiB, 1000)


def test_plain_arena_is_page_aligned_prefaulted_and_zero_copy():
    with create_host_arena(6, slot_bytes_for(100_000), pin=False) as host:
        assert isinstance(host.arena, Arena)
        assert len(host.arena) == host.num_slots == 6
        assert host.slot_bytes == 102400 and not host.pinned and host.shared_memory is None
        assert host.address % 4096 == 0
        assert host.resident_bytes() == 6 * 102400
        host.arena[2][:5] = b"hello"
        t = host.slot_tensor(2)
        assert bytes(t[:5].numpy()) == b"hello"
        t[5] = ord("!")  # writes through to what tiers see
        assert bytes(host.arena[2][:6]) == b"hello!"
        assert host.tensor().shape == (6, 102400)
        host.release([2])  # not elastic: a no-op, the bytes stay
        assert bytes(host.arena[2][:6]) == b"hello!"
        with pytest.raises(IndexError):
            host.slot_tensor(6)
    host.close()  # idempotent


def test_pin_without_an_accelerator_is_an_error_and_default_is_plain():
    if arena_mod.accelerator() is not None:
        pytest.skip("an accelerator is present")
    with pytest.raises(ConfigError, match="needs an accelerator"):
        create_host_arena(1, 4096, pin=True)
    with create_host_arena(1, 4096) as host:
        assert not host.pinned


def test_memory_shortfall_is_a_clear_error_at_creation():
    avail = arena_mod.mem_available()
    slots = avail // MiB + 1024
    with pytest.raises(ArenaSpaceError, match="MemAvailable") as ei:
        create_host_arena(slots, MiB, pin=False)
    assert isinstance(ei.value, MemoryError) and isinstance(ei.value, ValueError)
    assert str(slots) in str(ei.value)


def test_shm_shortfall_is_a_clear_error_and_leaves_nothing(monkeypatch, shm_name):
    monkeypatch.setattr(arena_mod, "shm_free", lambda path="/dev/shm": 2 * MiB)
    with pytest.raises(ArenaSpaceError, match=r"/dev/shm: 0\.00 GiB free"):
        create_host_arena(4, MiB, pin=False, shared_memory=shm_name)
    assert not os.path.exists(f"/dev/shm/{shm_name}")


def test_elastic_budget_shortfall_is_an_error():
    with pytest.raises(ArenaSpaceError, match="reserve"):
        create_host_arena(4, MiB, elastic=True, elastic_reserve_bytes=1 << 50)


RANK = textwrap.dedent("""
    import sys
    from kvtiers.engine.arena import create_host_arena
    name, rank, shard = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    host = create_host_arena(4, 2 * shard, pin=False, shared_memory=name, attach=True)
    assert host.shared_memory == name and not host.creator
    host.arena[3][rank * shard:(rank + 1) * shard] = bytes([rank + 1]) * shard
    host.close()
""")


def test_two_processes_write_their_shards_into_one_slot(shm_name):
    shard = 64 * 1024
    with create_host_arena(4, 2 * shard, pin=False, shared_memory=shm_name) as host:
        assert host.creator and os.path.exists(f"/dev/shm/{shm_name}")
        host.ndarray()[:] = 0xEE
        procs = [subprocess.Popen([sys.executable, "-c", RANK, shm_name, str(r), str(shard)]) for r in (0, 1)]
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
        slot = bytes(host.arena[3])
        assert slot == bytes([1]) * shard + bytes([2]) * shard  # both shards, side by side
        assert (host.ndarray()[:3] == 0xEE).all()  # other slots untouched
        assert os.path.exists(f"/dev/shm/{shm_name}")  # attachers do not unlink
    assert not os.path.exists(f"/dev/shm/{shm_name}")  # the creator does


def test_shm_attach_errors(shm_name):
    with pytest.raises(ConfigError, match="does not exist"):
        create_host_arena(2, 4096, pin=False, shared_memory=shm_name, attach=True)
    with create_host_arena(2, 4096, pin=False, shared_memory=shm_name):
        with pytest.raises(ConfigError, match="already exists"):
            create_host_arena(2, 4096, pin=False, shared_memory=shm_name)
        with pytest.raises(ConfigError, match="holds 8192 bytes"):
            create_host_arena(3, 4096, pin=False, shared_memory=shm_name, attach=True)
    with pytest.raises(ConfigError, match="plain name"):
        create_host_arena(2, 4096, pin=False, shared_memory="a/b")
    with pytest.raises(ConfigError, match="needs the shared_memory"):
        create_host_arena(2, 4096, pin=False, attach=True)


@pytest.mark.parametrize("shared", [False, True], ids=["anon", "shm"])
def test_elastic_pages_are_backed_on_demand_and_given_back(shared, shm_name):
    slots, slot_bytes = 64, MiB
    host = create_host_arena(slots, slot_bytes, elastic=True, elastic_max_bytes=48 * MiB,
                             elastic_reserve_bytes=0, shared_memory=shm_name if shared else None)
    try:
        assert host.elastic and not host.pinned
        assert host.resident_bytes() == 0  # reserved, not backed
        assert host.budget_slots() == 48  # the configured maximum is below MemAvailable here
        r0 = rss()
        arr = host.ndarray()
        arr[:32] = 7  # back 32 slots by writing them
        r1 = rss()
        assert host.resident_bytes() == 32 * slot_bytes
        assert r1 - r0 >= 30 * MiB
        host.release(range(8, 32))
        r2 = rss()
        assert host.resident_bytes() == 8 * slot_bytes
        assert r1 - r2 >= 22 * MiB  # the pages really went back
        arr[9] = 1  # backed again on write
        assert host.resident_bytes() == 9 * slot_bytes
        assert (arr[:8] == 7).all()  # live slots keep their bytes
        assert (arr[10:32] == 0).all()  # released slots read as zeros (reading maps them again)
    finally:
        host.close()
    if shared:
        assert not os.path.exists(f"/dev/shm/{shm_name}")


def test_elastic_budget_follows_live_free_memory(monkeypatch):
    host = create_host_arena(16, MiB, elastic=True, elastic_reserve_bytes=MiB)
    try:
        assert host.budget_slots() == 16
        monkeypatch.setattr(arena_mod, "mem_available", lambda: 5 * MiB)
        assert host.budget_slots() == 4  # 5 MiB free - 1 MiB reserve
        np.asarray(host.ndarray()[:2]).fill(1)
        assert host.budget_slots() == 6  # what the arena holds counts towards its budget
    finally:
        host.close()
