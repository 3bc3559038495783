"""Shared test set-up. ``s3_fixture`` is both imported by the obj tests (helpers) and loaded
as a pytest plugin (fixtures); registering it here lets pytest rewrite its asserts."""

import pytest

pytest.register_assert_rewrite("s3_fixture")
