"""obj tier faults against a real SeaweedFS server: a server that stops answering
(SIGSTOP), one that dies (SIGKILL) and comes back on the same directory and ports, close
while it is stuck, and a server with authentication rejecting wrong credentials."""

from __future__ import annotations

import logging
import time

import pytest
from s3_fixture import CREDENTIALS, fill, make_ctx, open_obj, options_for, resolve, run_job, wait_jobs

from kvtiers import Job, Lookup, TierError

pytest_plugins = ["s3_fixture"]

# small bounds so a stuck server costs seconds, not minutes
FAST = {"connect_timeout": 1.0, "read_timeout": 1.0, "max_attempts": 2, "op_timeout": 4.0}


@pytest.fixture
def fault_server(s3_fault_server):
    yield s3_fault_server
    s3_fault_server.resume()
    s3_fault_server.start()  # back up for the next test if a test killed it


@pytest.fixture
def k0_stored(fault_server):
    """An obj tier on the fault server with fast bounds, ``k0`` stored from slot 0:
    ``(ctx, tier, the bytes of k0)``; the tier is closed after the test."""
    ctx = make_ctx()
    h = open_obj(ctx, options_for(fault_server, **FAST))
    try:
        want = fill(ctx, 0, 1)
        assert run_job(h, True, [b"k0"], [0]).ok
        yield ctx, h, want
    finally:
        h.close()


def test_paused_server_fails_jobs_in_bounded_time_then_recovers(fault_server, k0_stored):
    ctx, h, want = k0_stored
    try:
        fault_server.pause()
        t0 = time.monotonic()
        h.submit_store(Job(2, (b"k1",), (1,)))
        h.submit_load(Job(3, (b"k0",), (2,)))
        assert time.monotonic() - t0 < 2.0  # submits never block (the server would hold them for seconds)
        t1 = time.monotonic()
        ans = h.lookup([b"unknown"])
        assert time.monotonic() - t1 < 2.0 and ans == [Lookup.RETRY]
        got = wait_jobs(h, [2, 3], timeout=30)
        assert got[2].failed_keys == (b"k1",) and got[3].failed_keys == (b"k0",)
        assert time.monotonic() - t0 < 20
        assert resolve(h, [b"unknown"], timeout=15) == [Lookup.MISS]  # no answer: a miss
        fault_server.resume()
        assert run_job(h, True, [b"k1"], [1], job_id=4, timeout=30).ok  # reconnects
        assert run_job(h, False, [b"k0"], [2], job_id=5, timeout=30).ok
        assert bytes(ctx.arena[2]) == want
    finally:
        fault_server.resume()


def test_killed_server_fails_fast_and_is_used_again_after_restart(fault_server, k0_stored):
    ctx, h, want = k0_stored
    fault_server.kill()
    t0 = time.monotonic()
    r = run_job(h, True, [b"k1"], [1], job_id=2, timeout=30)
    assert r.failed_keys == (b"k1",) and r.error
    r = run_job(h, False, [b"k0"], [2], job_id=3, timeout=30)
    assert r.failed_keys == (b"k0",)
    assert time.monotonic() - t0 < 20
    fault_server.start()  # same directory, same ports
    # The S3 endpoint answers before the restarted volume server takes writes; on a busy
    # machine that gap can outlast op_timeout, so the first store may fail: retry it.
    deadline, job_id = time.monotonic() + 90, 4
    while not run_job(h, True, [b"k1"], [1], job_id=job_id, timeout=30).ok:
        assert time.monotonic() < deadline, "the tier never stored again after the restart"
        job_id += 1
    assert run_job(h, False, [b"k0"], [2], job_id=job_id + 1, timeout=30).ok
    assert bytes(ctx.arena[2]) == want


def test_close_with_a_stuck_server_is_bounded_and_reports_every_job(fault_server):
    ctx = make_ctx()
    h = open_obj(ctx, options_for(fault_server, **FAST))
    fault_server.pause()
    try:
        for j in range(4):
            h.submit_store(Job(j, (f"c{j}".encode(),), (j,)))
        t0 = time.monotonic()
        h.close()
        assert time.monotonic() - t0 < 30
        got = {r.job_id: r for r in h.get_finished_jobs()}
        assert sorted(got) == [0, 1, 2, 3] and all(not r.ok for r in got.values())
    finally:
        fault_server.resume()


def test_wrong_credentials_are_a_clear_error_and_never_logged(s3_auth_server, caplog):
    good = options_for(s3_auth_server, aws_access_key_id=CREDENTIALS[0], aws_secret_access_key=CREDENTIALS[1])
    caplog.set_level(logging.DEBUG)
    ctx = make_ctx()
    h = open_obj(ctx, good)  # right credentials: creates the bucket, works
    try:
        fill(ctx, 0, 0)
        assert run_job(h, True, [b"k"], [0]).ok
    finally:
        h.close()
    bad = dict(good, aws_secret_access_key="not-the-secret-" + "x" * 8)
    with pytest.raises(TierError, match="access denied") as ei:
        open_obj(make_ctx(), bad)
    msg = str(ei.value)
    assert "\n" not in msg and "not-the-secret" not in msg and CREDENTIALS[1] not in msg
    assert CREDENTIALS[1] not in caplog.text and "not-the-secret" not in caplog.text


def test_no_credentials_against_an_auth_server_says_unsigned(s3_auth_server, monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(TierError, match="unsigned"):
        open_obj(make_ctx(), options_for(s3_auth_server))


def test_an_empty_credential_chain_is_walked_once_and_credentials_set_later_are_used(s3_auth_server, monkeypatch,
                                                                                      tmp_path):
    """botocore walks its whole chain (IMDS included) each time it found nothing: 70-100 ms
    per unsigned open here, seconds where IMDS does not answer. The tier believes "none" a
    while, but not once the AWS_* environment changes."""
    from kvtiers_obj import client

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setattr(client, "_session", None)  # a session of this test's own (it keeps what it finds)
    monkeypatch.setattr(client, "_none_found", None)
    session = client.shared_session()
    walks = []
    real = session.get_credentials

    async def counted():
        walks.append(1)
        return await real()

    monkeypatch.setattr(session, "get_credentials", counted)
    for _ in range(2):
        with pytest.raises(TierError, match="unsigned"):
            open_obj(make_ctx(), options_for(s3_auth_server))
    assert len(walks) == 1
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", CREDENTIALS[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CREDENTIALS[1])
    ctx = make_ctx()
    h = open_obj(ctx, options_for(s3_auth_server))  # the chain finds them now: signed, accepted
    try:
        fill(ctx, 0, 0)
        assert run_job(h, True, [b"k"], [0]).ok
    finally:
        h.close()
