"""Shared test set-up. ``s3_fixture`` is both imported by the obj tests (helpers) and loaded
as a pytest plugin (fixtures); registering it here lets pytest rewrite its asserts. ``env`` is
the fs tests' tier environment on a fresh root directory. ``engine_runs`` starts the real
vLLM engines of every selected module that defines ``run_engines(workdir)``
(``tests/vllm_engines.py``), all at once, the first time one module asks for its own."""

import pytest

pytest.register_assert_rewrite("s3_fixture")


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
        if module is not None and callable(getattr(module, "run_engines", None)) and module not in modules:
            modules.append(module)
    runs = EngineRuns(modules, lambda name: tmp_path_factory.mktemp(name.rpartition(".")[2]))
    yield runs
    runs.close()
