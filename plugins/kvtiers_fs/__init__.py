"""kvtiers_fs: the first-party file-system tier (type ``fs``) and its CLI.

One checksummed file per chunk under ``root_dir/<namespace digest>/``, O_DIRECT where the
file system allows it, a bounded LRU that survives restarts, safe to share between many
instances. Registered through the ``kvtiers`` entry point ``fs = "kvtiers_fs"``.
"""

from __future__ import annotations

import kvtiers

from .tier import FsTier

__all__ = ["FsTier"]


@kvtiers.hookimpl
def register_tiers(register) -> None:
    register("fs", FsTier)


@kvtiers.hookimpl
def register_commands(cli) -> None:
    from .cli import bench_fs, fs
    from .scale_cli import with_scale

    cli.add_command(fs)
    bench = cli.commands.get("bench")
    if bench is not None:
        bench.add_command(with_scale(bench_fs), "fs")  # `kvtiers bench fs --scale N`
