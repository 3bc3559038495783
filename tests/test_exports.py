"""The package's public names: the contract eagerly, the engine side on first use."""

import subprocess
import sys

import kvtiers


def test_engine_names_resolve_lazily_to_their_modules() -> None:
    from kvtiers.engine.arena import create_host_arena
    from kvtiers.engine.layout import KVLayout
    from kvtiers.engine.manager import TieringManager
    from kvtiers.engine.types import Request, TransferResult

    assert kvtiers.TieringManager is TieringManager
    assert kvtiers.Request is Request and kvtiers.TransferResult is TransferResult
    assert kvtiers.KVLayout is KVLayout and kvtiers.create_host_arena is create_host_arena
    assert set(kvtiers.__all__) >= {"TieringManager", "Job", "Arena", "AsyncTier"}


def test_import_kvtiers_does_not_load_the_engine_side() -> None:
    code = ("import sys, kvtiers; "
            "print(sorted(m for m in ('kvtiers.engine.manager', 'kvtiers.engine.dma', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        kvtiers.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("kvtiers.NoSuchThing resolved")
