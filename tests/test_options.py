"""Checking tier options against the keyword-only ``__init__`` signature and its hints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Optional

import pytest

import kvtiers
from kvtiers import Arena, ConfigError, Job, JobResult, Lookup, TierContext, open_tier
from kvtiers.options import check_options, describe, tier_options


class OptTier:
    """A minimal valid tier with one option of each kind the checker understands."""

    def __init__(
        self,
        ctx: TierContext,
        *,
        root_dir: str,
        max_bytes: int | None = None,
        fsync: bool = False,
        ratio: float = 0.5,
        legacy: Optional[int] = None,  # noqa: UP045 - the old spelling must work too
        hosts: list[str] = (),  # type: ignore[assignment]
        labels: dict[str, int] | None = None,
        mode: Literal["a", "b"] = "a",
        pair: tuple[int, str] = (0, ""),
        anything: Any = None,
        untyped=None,
    ) -> None:
        self.ctx = ctx
        self.options = dict(root_dir=root_dir, max_bytes=max_bytes, fsync=fsync, ratio=ratio, mode=mode)

    @kvtiers.hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        return [Lookup.MISS for _ in keys]

    @kvtiers.hookimpl
    def submit_store(self, job: Job) -> None:
        pass

    @kvtiers.hookimpl
    def submit_load(self, job: Job) -> None:
        pass

    @kvtiers.hookimpl
    def get_finished_jobs(self) -> list[JobResult]:
        return []


def check(**options: Any) -> dict[str, Any]:
    return check_options("opt", OptTier, {"root_dir": "/r", **options})


def test_keyword_only_parameters_are_the_options() -> None:
    params = tier_options(OptTier)
    assert "ctx" not in params
    assert set(params) == {
        "root_dir", "max_bytes", "fsync", "ratio", "legacy", "hosts", "labels", "mode", "pair", "anything", "untyped",
    }


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_bytes": None},
        {"max_bytes": 1 << 40},
        {"fsync": True},
        {"ratio": 1},  # an int is a fine float
        {"ratio": 0.25},
        {"legacy": None},
        {"legacy": 3},
        {"hosts": ["a", "b"]},
        {"hosts": []},
        {"labels": {"x": 1}},
        {"labels": None},
        {"mode": "b"},
        {"pair": [1, "x"]},
        {"anything": {"deep": [1, None]}},
        {"untyped": object()},
    ],
)
def test_valid_options_pass_unchanged(options: dict[str, Any]) -> None:
    assert check(**options) == {"root_dir": "/r", **options}


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("root_dir", 5, "expects str, got int 5"),
        ("max_bytes", "1G", "expects int | None, got str '1G'"),
        ("max_bytes", True, "expects int | None, got bool True"),  # bool is not an int here
        ("max_bytes", 1.5, "expects int | None, got float 1.5"),
        ("fsync", 1, "expects bool, got int 1"),
        ("fsync", "true", "expects bool, got str 'true'"),
        ("ratio", False, "expects float, got bool False"),
        ("legacy", "3", "expects int | None, got str '3'"),
        ("hosts", "a,b", "expects list[str], got str 'a,b'"),
        ("hosts", ["a", 2], "expects list[str], got list ['a', 2]"),
        ("labels", {"x": "1"}, "expects dict[str, int] | None, got dict {'x': '1'}"),
        ("labels", [["x", 1]], "expects dict[str, int] | None"),
        ("mode", "c", "expects 'a' | 'b', got str 'c'"),
        ("pair", [1, 2], "expects tuple[int, str], got list [1, 2]"),
        ("pair", [1], "expects tuple[int, str]"),
    ],
)
def test_wrong_type_names_tier_option_and_expectation(key: str, value: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        check(**{key: value})
    msg = str(e.value)
    assert msg.startswith(f"tier 'opt': option {key!r} ")
    assert expected in msg
    assert "\n" not in msg


def test_unknown_option_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as e:
        check(root_dri="/x")
    msg = str(e.value)
    assert msg.startswith("tier 'opt': unknown option 'root_dri' (options: ")
    assert "root_dir" in msg and "max_bytes" in msg
    assert "\n" not in msg


def test_ctx_is_not_an_option() -> None:
    with pytest.raises(ConfigError, match="unknown option 'ctx'"):
        check(ctx=None)


def test_missing_required_option() -> None:
    with pytest.raises(ConfigError) as e:
        check_options("opt", OptTier, {})
    assert str(e.value) == "tier 'opt': missing required option 'root_dir' (str)"


def test_tier_without_options_rejects_any() -> None:
    class Bare:
        def __init__(self, ctx: TierContext) -> None: ...

    assert check_options("bare", Bare, {}) == {}
    with pytest.raises(ConfigError, match=r"tier 'bare': unknown option 'x' \(options: none\)"):
        check_options("bare", Bare, {"x": 1})


def test_unresolvable_hints_fall_back_to_names() -> None:
    class Odd:
        def __init__(self, ctx: TierContext, *, thing: NoSuchType = None) -> None: ...  # type: ignore[name-defined] # noqa: F821

    assert check_options("odd", Odd, {"thing": 123}) == {"thing": 123}
    with pytest.raises(ConfigError, match="unknown option 'other'"):
        check_options("odd", Odd, {"other": 1})


def test_describe_names_types_readably() -> None:
    assert describe(int | None) == "int | None"
    assert describe(Optional[str]) == "str | None"  # noqa: UP045
    assert describe(list[str]) == "list[str]"
    assert describe(dict[str, int]) == "dict[str, int]"
    assert describe(Literal["lru", "arc"]) == "'lru' | 'arc'"
    assert describe(Any) == "any value"


# -- through open_tier: checked before construction ---------------------------------------


class Constructed(Exception):
    pass


class LoudTier(OptTier):
    """Raises if constructed: proves options are checked before ``__init__`` runs."""

    def __init__(self, ctx: TierContext, *, size: int) -> None:
        raise Constructed


def test_open_tier_checks_options_before_construction() -> None:
    ctx = TierContext(Arena.allocate(1, 4096))
    with pytest.raises(ConfigError, match="option 'size' expects int, got str 'big'"):
        open_tier(LoudTier, {"size": "big"}, ctx)
    with pytest.raises(ConfigError, match="unknown option 'sise'"):
        open_tier(LoudTier, {"sise": 1}, ctx)
    # a valid config does reach the constructor (wrapped as a TierError naming the tier)
    with pytest.raises(kvtiers.TierError, match="could not open: Constructed"):
        open_tier(LoudTier, {"size": 1}, ctx)


def test_open_tier_error_names_the_registered_tier() -> None:
    ctx = TierContext(Arena.allocate(1, 4096))
    with pytest.raises(ConfigError) as e:
        open_tier("memory", {"max_bytes": "10"}, ctx)
    assert str(e.value) == "tier 'memory': option 'max_bytes' expects int | None, got str '10'"
    with pytest.raises(ConfigError) as e:
        open_tier("memory", {"max_byte": 10}, ctx)
    assert str(e.value) == "tier 'memory': unknown option 'max_byte' (options: max_bytes)"


def test_open_tier_passes_checked_options() -> None:
    ctx = TierContext(Arena.allocate(1, 4096))
    h = open_tier(OptTier, {"root_dir": "/r", "fsync": True, "mode": "b"}, ctx)
    try:
        assert h.tier.options == {"root_dir": "/r", "max_bytes": None, "fsync": True, "ratio": 0.5, "mode": "b"}
        assert h.options == {"root_dir": "/r", "fsync": True, "mode": "b"}
    finally:
        h.close()
