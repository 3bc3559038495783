"""Discovery by entry point and by import path, pluggy validation, the tier handle."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import click
import pytest
from tier_helpers import wait_job

import kvtiers
from kvtiers import Arena, ConfigError, Job, JobResult, Lookup, TierContext, TierError, get_registry, open_tier
from kvtiers.memory import MemoryTier
from kvtiers.registry import Registry, tier_levels, validate_tier_class

PLUGIN_SRC = '''
"""A throwaway third-party tier plugin, built by the tests."""
import click

import kvtiers
from kvtiers.memory import MemoryTier


class {cls}(MemoryTier):
    levels = frozenset({{"core", "durable"}})


@kvtiers.hookimpl
def register_tiers(register):
    register({tier!r}, {cls})


@kvtiers.hookimpl
def register_commands(cli):
    @cli.command({tier!r} + "-hello")
    def hello():
        """Say hello from the plugin."""
        click.echo("hello from {tier}")
'''


def make_dist(
    root: Path,
    module: str,
    *,
    tier: str | None = None,
    dist: str | None = None,
    version: str = "1.2.3",
    src: str | None = None,
    entry_points: str | None = None,
) -> Path:
    """A distribution as pip would leave it: a package plus a ``.dist-info`` next to it."""
    tier = tier or module
    dist = dist or module.replace("_", "-")
    pkg = root / module
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(src if src is not None else PLUGIN_SRC.format(cls="ThrowawayTier", tier=tier))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points or f"[kvtiers]\n{tier} = {module}\n")
    (info / "top_level.txt").write_text(module + "\n")
    return root


def kvtiers_cli(*args: str, path: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, **(env or {}))
    if path is not None:
        e["PYTHONPATH"] = os.pathsep.join([str(path), e.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "kvtiers.commands", *args], capture_output=True, text=True, env=e, timeout=120
    )


@pytest.fixture
def ctx() -> TierContext:
    return TierContext(Arena.allocate(4, 4096))


# -- entry points ------------------------------------------------------------------


def test_memory_tier_is_found_through_its_entry_point() -> None:
    info = get_registry().tier_info("memory")
    assert info.cls is MemoryTier
    assert info.distribution == "kvtiers"
    assert info.version == kvtiers.__version__
    assert info.origin == "entry point memory"
    assert info.levels == {"core", "bounded"}
    assert "memory" in [t.name for t in get_registry().tiers()]


def test_throwaway_distribution_is_discovered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(make_dist(tmp_path, "kvtiers_throwaway_a", tier="throwaway-a")))
    reg = Registry()
    info = reg.tier_info("throwaway-a")
    assert info.cls.__name__ == "ThrowawayTier"
    assert info.distribution == "kvtiers-throwaway-a"
    assert info.version == "1.2.3"
    assert info.origin == "entry point throwaway-a"
    assert info.levels == {"core", "durable"}
    assert reg.tier_info("memory").cls is MemoryTier  # the others are still there
    names = [t.name for t in reg.tiers()]
    assert names == sorted(names)
    # its commands are offered to whatever group it is given
    group = click.Group()
    reg.add_commands(group)
    assert "throwaway-a-hello" in group.commands


def test_throwaway_distribution_opens_and_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ctx) -> None:
    monkeypatch.syspath_prepend(str(make_dist(tmp_path, "kvtiers_throwaway_b", tier="throwaway-b")))
    h = open_tier("throwaway-b", {"max_bytes": 1 << 20}, ctx, registry=Registry())
    try:
        ctx.arena[0][:3] = b"abc"
        h.submit_store(Job(1, (b"k",), (0,)))
        assert wait_job(h, 1).ok
        assert h.lookup([b"k", b"z"]) == [Lookup.HIT, Lookup.MISS]
        assert h.levels == {"core", "durable"}
    finally:
        h.close()


def test_kvtiers_tiers_lists_the_throwaway_distribution(tmp_path: Path) -> None:
    make_dist(tmp_path, "kvtiers_throwaway_c", tier="throwaway-c", version="0.7")
    r = kvtiers_cli("tiers", path=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = dict((line.split("\t")[0], line) for line in r.stdout.splitlines())
    assert lines["throwaway-c"] == "throwaway-c\tkvtiers-throwaway-c\t0.7\tentry point throwaway-c\tlevels=core,durable"
    assert lines["memory"].startswith(f"memory\tkvtiers\t{kvtiers.__version__}\tentry point memory\t")
    # and its command joined the kvtiers group
    r = kvtiers_cli("throwaway-c-hello", path=tmp_path)
    assert (r.returncode, r.stdout) == (0, "hello from throwaway-c\n")


def test_broken_plugin_is_reported_and_does_not_hide_others(tmp_path: Path) -> None:
    make_dist(tmp_path, "kvtiers_broken", src="raise ImportError('no backend library')\n")
    r = kvtiers_cli("tiers", path=tmp_path)
    assert r.returncode == 0
    assert any(line.startswith("memory\t") for line in r.stdout.splitlines())
    assert "# plugin kvtiers_broken failed to load: ImportError: no backend library" in r.stderr


def test_plugin_registering_an_invalid_tier_is_an_error_entry(tmp_path: Path, monkeypatch) -> None:
    src = textwrap.dedent('''
        import kvtiers

        class Misspelt:
            @kvtiers.hookimpl
            def lokup(self, keys): ...

        @kvtiers.hookimpl
        def register_tiers(register):
            register("misspelt", Misspelt)
    ''')
    monkeypatch.syspath_prepend(str(make_dist(tmp_path, "kvtiers_misspelt", tier="misspelt", src=src)))
    reg = Registry()
    assert "misspelt" not in [t.name for t in reg.tiers()]
    assert "unknown hook 'lokup'" in reg.errors["misspelt"]
    with pytest.raises(ConfigError, match="unknown tier type 'misspelt'"):
        reg.tier_info("misspelt")


def test_two_plugins_claiming_one_name(tmp_path: Path, monkeypatch) -> None:
    make_dist(tmp_path, "kvtiers_dup_one", tier="dup")
    make_dist(tmp_path, "kvtiers_dup_two", tier="dup", entry_points="[kvtiers]\ndup2 = kvtiers_dup_two\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry()
    assert reg.tier_info("dup").distribution in {"kvtiers-dup-one", "kvtiers-dup-two"}
    (err,) = [v for v in reg.errors.values() if "registered twice" in v]
    assert "tier 'dup' registered twice" in err


# -- import paths ------------------------------------------------------------------


def test_import_path_to_an_installed_class() -> None:
    info = get_registry().tier_info("kvtiers.memory:MemoryTier")
    assert info.cls is MemoryTier
    assert (info.distribution, info.version, info.origin) == ("kvtiers", kvtiers.__version__, "import path")
    assert info.name == "kvtiers.memory:MemoryTier"


def test_import_path_into_a_throwaway_distribution(tmp_path: Path, monkeypatch, ctx) -> None:
    src = PLUGIN_SRC.format(cls="Outer", tier="nested") + "\n\nclass Holder:\n    Inner = Outer\n"
    monkeypatch.syspath_prepend(str(make_dist(tmp_path, "kvtiers_imported", tier="nested", src=src, version="4.5")))
    info = Registry().tier_info("kvtiers_imported:Holder.Inner")
    assert info.cls.__name__ == "Outer"
    assert (info.distribution, info.version, info.origin) == ("kvtiers-imported", "4.5", "import path")
    h = open_tier("kvtiers_imported:Holder.Inner", {}, ctx)
    try:
        assert h.lookup([b"x"]) == [Lookup.MISS]
    finally:
        h.close()


def test_import_path_to_a_module_outside_any_distribution(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "loose_tier_mod.py").write_text("from kvtiers.memory import MemoryTier as Loose\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    info = get_registry().tier_info("loose_tier_mod:Loose")
    assert info.cls is MemoryTier
    assert (info.distribution, info.version) == ("?", "?")


@pytest.mark.parametrize(
    "path,match",
    [
        ("no_such_module_xyz:Tier", r"tier type 'no_such_module_xyz:Tier': cannot import"),
        ("kvtiers.memory:NoSuchTier", r"tier type 'kvtiers.memory:NoSuchTier': cannot import"),
    ],
)
def test_bad_import_paths(path: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        get_registry().tier_info(path)


def test_import_path_to_a_non_class() -> None:
    with pytest.raises(TierError, match="tier 'kvtiers.memory:register_tiers': expected a class, got"):
        get_registry().tier_info("kvtiers.memory:register_tiers")


def test_unknown_type_lists_registered_ones() -> None:
    with pytest.raises(ConfigError) as e:
        get_registry().tier_info("memroy")
    msg = str(e.value)
    assert msg.startswith("unknown tier type 'memroy' (registered: ")
    assert "memory" in msg and "pkg.module:Class" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="non-empty string"):
        get_registry().tier_info("")


# -- pluggy validation at start-up ------------------------------------------------------


class GoodTier:
    def __init__(self, ctx: TierContext) -> None:
        self.ctx = ctx

    @kvtiers.hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        return [Lookup.MISS] * len(keys)

    @kvtiers.hookimpl
    def submit_store(self, job: Job) -> None: ...

    @kvtiers.hookimpl
    def submit_load(self, job: Job) -> None: ...

    @kvtiers.hookimpl
    def get_finished_jobs(self) -> list[JobResult]:
        return []


class MisspeltHook(GoodTier):
    @kvtiers.hookimpl
    def submit_lod(self, job: Job) -> None: ...


class WrongArgument(GoodTier):
    @kvtiers.hookimpl
    def lookup(self, key: bytes) -> list[Lookup]:  # type: ignore[override]
        return []


class MissingHook(GoodTier):
    submit_load = None  # type: ignore[assignment]


class Unmarked(GoodTier):
    def get_finished_jobs(self) -> list[JobResult]:  # no @hookimpl: pluggy never calls it
        return []


class BadLevel(GoodTier):
    levels = frozenset({"core", "eternal"})


@pytest.mark.parametrize(
    "cls,match",
    [
        (MisspeltHook, r"unknown hook 'submit_lod'"),
        (WrongArgument, r"hook 'lookup'.*Argument\(s\) \{'key'\}"),
        (MissingHook, r"missing required hook\(s\) submit_load \(mark them with @kvtiers.hookimpl\)"),
        (Unmarked, r"missing required hook\(s\) get_finished_jobs"),
        (BadLevel, r"unknown conformance level\(s\) \['eternal'\]"),
    ],
)
def test_invalid_tier_class_is_a_tier_error_at_start_up(cls: type, match: str, ctx) -> None:
    with pytest.raises(TierError, match=match) as e:
        validate_tier_class("bad", cls)
    assert "\n" not in str(e.value)
    with pytest.raises(TierError, match=match):
        open_tier(cls, {}, ctx)


def test_levels_default_to_core() -> None:
    validate_tier_class("good", GoodTier)
    assert tier_levels(GoodTier) == {"core"}


# -- the tier handle ------------------------------------------------------------------


def test_handle_answers_optional_hooks_the_tier_lacks(ctx) -> None:
    h = open_tier(GoodTier, {}, ctx)
    assert h.backlog() == 0
    assert h.touch([b"a"]) is None
    assert h.get_finished_jobs() == []
    assert h.levels == {"core"}
    h.close()
    h.close()  # idempotent
    assert h.closed


def test_wrappers_see_and_can_alter_every_tier_hook(ctx) -> None:
    calls: list[str] = []

    class Spy:
        @kvtiers.hookimpl(wrapper=True)
        def lookup(self, keys):
            calls.append("lookup")
            answers = yield
            return [Lookup.RETRY if k == b"hidden" else a for k, a in zip(keys, answers, strict=True)]

        @kvtiers.hookimpl(wrapper=True)
        def submit_store(self, job):
            calls.append(f"store {job.job_id}")
            return (yield)

        @kvtiers.hookimpl(wrapper=True)
        def submit_load(self, job):
            calls.append(f"load {job.job_id}")
            return (yield)

        @kvtiers.hookimpl(wrapper=True)
        def get_finished_jobs(self):
            results = yield
            calls.append(f"finished {[r.job_id for r in results]}")
            return results

        @kvtiers.hookimpl(wrapper=True)
        def touch(self, keys):
            calls.append("touch")
            return (yield)

        @kvtiers.hookimpl(wrapper=True)
        def backlog(self):
            calls.append("backlog")
            return (yield)

        @kvtiers.hookimpl(wrapper=True)
        def close(self):
            calls.append("close")
            return (yield)

    h = open_tier("memory", {}, ctx)
    h.add_wrapper(Spy(), name="spy")
    h.submit_store(Job(1, (b"hidden", b"shown"), (0, 1)))
    assert wait_job(h, 1).ok
    assert h.lookup([b"hidden", b"shown"]) == [Lookup.RETRY, Lookup.HIT]
    h.submit_load(Job(2, (b"shown",), (2,)))
    assert wait_job(h, 2).ok
    h.touch([b"shown"])
    assert h.backlog() == 0
    h.close()
    calls = [c for c in calls if c != "finished []"]  # wait_job polls until each result is there
    assert calls == ["store 1", "finished [1]", "lookup", "load 2", "finished [2]", "touch", "backlog", "close"]


def test_open_tier_wraps_constructor_failures(ctx) -> None:
    class Exploding(GoodTier):
        def __init__(self, ctx: TierContext, *, path: str = "") -> None:
            raise OSError(13, "Permission denied", path)

    with pytest.raises(TierError) as e:
        open_tier(Exploding, {"path": "/root/x"}, ctx)
    assert "could not open: PermissionError: [Errno 13] Permission denied: '/root/x'" in str(e.value)
    assert isinstance(e.value.__cause__, PermissionError)


def test_open_tier_lets_config_errors_from_the_constructor_through(ctx) -> None:
    class Picky(GoodTier):
        def __init__(self, ctx: TierContext, *, size: int = 1) -> None:
            raise ConfigError("tier 'picky': option 'size' must be a power of two")

    with pytest.raises(ConfigError, match="power of two"):
        open_tier(Picky, {"size": 3}, ctx)
