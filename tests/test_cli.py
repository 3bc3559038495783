"""The ``kvtiers`` command: --help, ``kvtiers tiers`` format, lazy commands, error exits."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

import kvtiers
from kvtiers import ConfigError, TierError
from kvtiers.commands.cli import LazyGroup, cli, main
from kvtiers.registry import LEVELS, get_registry


def run_kvtiers(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtiers.commands", *args], capture_output=True, text=True,
                          timeout=120)


def test_help_lists_the_commands() -> None:
    r = run_kvtiers("--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Usage: kvtiers [OPTIONS] COMMAND [ARGS]...")
    for name in ("tiers", "conformance", "demo", "bench"):
        assert f"\n  {name} " in r.stdout, name


@pytest.mark.parametrize("args", [["tiers", "--help"], ["bench", "--help"], ["-h"]])
def test_help_everywhere(args: list[str]) -> None:
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert "Usage:" in r.output


def test_bench_group_lists_its_lazy_subcommand() -> None:
    r = CliRunner().invoke(cli, ["bench", "--help"])
    assert "arena" in r.output


def test_version() -> None:
    r = CliRunner().invoke(cli, ["--version"])
    assert r.exit_code == 0
    assert kvtiers.__version__ in r.output


def test_tiers_output_format() -> None:
    r = run_kvtiers("tiers")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    infos = get_registry().tiers()
    assert len(lines) == len(infos) >= 1
    for line, info in zip(lines, infos, strict=True):
        name, dist, version, origin, levels = line.split("\t")
        assert name == info.name  # starts with the type name, sorted like the registry
        assert (dist, version, origin) == (info.distribution, info.version, info.origin)
        assert levels.startswith("levels=")
        claimed = levels.removeprefix("levels=").split(",")
        assert claimed == sorted(claimed) and set(claimed) <= set(LEVELS)
    assert f"memory\tkvtiers\t{kvtiers.__version__}\tentry point memory\tlevels=bounded,core" in lines


def test_unknown_command_exits_2() -> None:
    r = run_kvtiers("no-such-command")
    assert r.returncode == 2
    assert "No such command 'no-such-command'" in r.stderr


@pytest.mark.parametrize("exc", [ConfigError("tier 'fs': option 'root_dir' expects str, got int 5"),
                                 TierError("tier 'fs': could not open: PermissionError")])
def test_main_turns_config_and_tier_errors_into_one_line_exit_2(exc, capsys) -> None:
    @click.command("test-raise")
    def raiser() -> None:
        raise exc

    cli.add_command(raiser)
    try:
        assert main(["test-raise"]) == 2
    finally:
        del cli.commands["test-raise"]
    err = capsys.readouterr().err
    assert err == f"kvtiers: error: {exc}\n"


def test_main_reports_click_errors_with_their_exit_code(capsys) -> None:
    assert main(["tiers", "--bogus"]) == 2
    assert "No such option '--bogus'" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "Usage: kvtiers" in capsys.readouterr().out


def test_lazy_group_imports_on_first_use_and_degrades_when_missing() -> None:
    group = LazyGroup(
        name="g",
        lazy={
            "present": ("kvtiers.commands.cli:tiers", "List tiers."),
            "absent": ("no_such_module_for_kvtiers:cmd", "Needs an extra."),
        },
    )
    assert group.list_commands(click.Context(group)) == ["absent", "present"]
    r = CliRunner().invoke(group, ["--help"])
    assert r.exit_code == 0
    assert "absent" in r.output and "present" in r.output
    r = CliRunner().invoke(group, ["absent", "--anything", "x"])
    assert r.exit_code == 1
    assert "'kvtiers absent' needs no_such_module_for_kvtiers, which is not installed" in r.output
    r = CliRunner().invoke(group, ["absent", "--help"])
    assert "unavailable: no_such_module_for_kvtiers is not installed" in r.output
    r = CliRunner().invoke(group, ["present"])
    assert r.exit_code == 0 and "memory\t" in r.output
