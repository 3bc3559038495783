"""Shared test set-up. ``s3_fixture`` is both imported by the obj tests (helpers) and loaded
as a pytest plugin (fixtures); registering it here lets pytest rewrite its asserts. ``env`` is
the fs tests' tier environment on a fresh root directory."""

import pytest

pytest.register_assert_rewrite("s3_fixture")


@pytest.fixture
def env(tmp_path):
    """An fs-tier test environment (:class:`test_fs_helpers.Env`) rooted in ``tmp_path``."""
    from test_fs_helpers import Env

    e = Env(str(tmp_path / "root"))
    yield e
    e.close()
