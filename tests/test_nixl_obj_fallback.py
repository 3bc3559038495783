"""The obj tier's NIXL path when NIXL's OBJ canary crashes (injected into the canary child
with ``KVTIERS_NIXL_CANARY_FAULT``), against a real SeaweedFS server: the tier moves its
bytes with aiobotocore instead, with one warning naming the cause and the fallback, and
says so in ``data_path``; ``nixl_strict`` makes it an error at open."""

from __future__ import annotations

import pytest
from kvtiers_nixl import canary
from s3_fixture import fill, make_ctx, open_obj, options_for, run_job

from kvtiers import TierError

pytest_plugins = ["s3_fixture"]

pytest.importorskip("nixl_cu12")


@pytest.fixture
def crashing(monkeypatch, tmp_path):
    monkeypatch.setenv(canary.CACHE_ENV, str(tmp_path / "canary"))
    monkeypatch.setenv(canary.FAULT_ENV, "segv@transfer")
    canary.forget()
    yield
    canary.forget()


def test_obj_tier_falls_back_to_aiobotocore_loudly(s3_server, crashing, caplog):
    ctx = make_ctx(4)
    with caplog.at_level("WARNING"):
        h = open_obj(ctx, options_for(s3_server, backend="nixl"))
    try:
        assert h.tier.data_path == "aiobotocore" and h.tier._nixl is None
        lines = [r.getMessage() for r in caplog.records if "NIXL is off" in r.getMessage()]
        assert lines == ["tier 'obj': NIXL is off in this process: NIXL's OBJ canary process was killed by SIGSEGV "
                         "at 'transfer'; using aiobotocore instead (docs/p2p.md, 'NIXL and RDMA drivers')"]
        data = fill(ctx, 0, 7)
        assert run_job(h, True, [b"k"], [0]).ok
        ctx.arena[1][:] = b"\0" * ctx.arena.slot_bytes
        assert run_job(h, False, [b"k"], [1], job_id=2).ok and bytes(ctx.arena[1]) == data
    finally:
        h.close()


def test_obj_tier_strict_is_an_error_at_open(s3_server, crashing):
    with pytest.raises(TierError, match=r"tier 'obj': NIXL is unsafe in this process \(NIXL's OBJ canary process "
                                        r"was killed by SIGSEGV at 'transfer'\); nixl_strict is set"):
        open_obj(make_ctx(2), options_for(s3_server, backend="nixl", nixl_strict=True))


def test_obj_tier_uses_nixl_when_the_canary_passes(s3_server, monkeypatch, tmp_path):
    monkeypatch.setenv(canary.CACHE_ENV, str(tmp_path / "canary"))
    monkeypatch.delenv(canary.FAULT_ENV, raising=False)
    canary.forget()
    h = open_obj(make_ctx(2), options_for(s3_server, backend="nixl"))
    try:
        assert h.tier.data_path == "nixl" and h.tier._nixl is not None
    finally:
        h.close()
