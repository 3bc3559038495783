"""The LMCache adapter's worker (kvtiers.integrations.lmcache.runner) on a real fs tier, in
this process: it needs neither LMCache nor torch. A tier whose polls keep raising is given up
instead of leaving LMCache's tasks waiting forever, and opened again later."""

from __future__ import annotations

import queue

from kvtiers.integrations.lmcache import runner as runner_module
from kvtiers.integrations.lmcache.mapping import Layout, Space
from kvtiers.integrations.lmcache.params import AdapterParams
from kvtiers.integrations.lmcache.runner import Item, Task, TierRunner

OBJ = 8192
SPACE = Space("org/model", 0, 0, Layout(((OBJ,),), ("torch.uint8",), OBJ))


def task(kind: str, keys: list[bytes], bufs: list[bytearray] | None = None) -> Task:
    bufs = bufs or [None] * len(keys)
    items = [Item(SPACE, k, buf=None if b is None else memoryview(b)) for k, b in zip(keys, bufs, strict=True)]
    return Task(kind, 0, items)


def test_a_tier_whose_polls_keep_raising_is_given_up_then_opened_again(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(runner_module, "POLL_GIVE_UP_S", 0.5)
    done: queue.Queue[Task] = queue.Queue()
    r = TierRunner(AdapterParams("fs", {"root_dir": str(tmp_path / "kv")}, staging_slots=4), None, done.put)
    keys = [b"chunk-a", b"chunk-b"]
    data = [bytearray(bytes([i + 1]) * OBJ) for i in range(2)]
    try:
        r.submit(task("store", keys, data))
        assert done.get(timeout=30).ok == [True, True]
        old = r._spaces[SPACE].handle

        def raising() -> list:  # fault injection: the tier's poll breaks
            raise OSError("poll broke")

        monkeypatch.setattr(old, "get_finished_jobs", raising)
        into = [bytearray(OBJ) for _ in keys]
        r.submit(task("load", keys, into))
        got = done.get(timeout=30)  # waited forever before: the job was never reported
        assert got.ok == [False, False]
        assert old.closed  # closed (rule 9: its threads gone) before its jobs were failed
        assert r.spaces()[SPACE].startswith("given up: get_finished_jobs raised on every poll")
        assert "OSError: poll broke" in caplog.text
        polls = [rec for rec in caplog.records if "polling the tier" in rec.getMessage()]
        assert len(polls) == 1  # warned once, not on every poll (every 0.1-0.5 ms)
        r.submit(task("lookup", keys))
        assert done.get(timeout=30).ok == [False, False]  # misses while given up

        monkeypatch.setattr(runner_module, "REOPEN_S", 0.0)  # opened again: the chunks are there
        r.submit(task("lookup", keys))
        assert done.get(timeout=30).ok == [True, True]
        r.submit(task("load", keys, into))
        assert done.get(timeout=30).ok == [True, True] and into == data
    finally:
        r.close()

