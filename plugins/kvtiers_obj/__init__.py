"""kvtiers_obj: the ``obj`` tier, KV chunks in an S3-compatible object store.

Registered through the ``kvtiers`` entry point. This module imports without aiobotocore
(``kvtiers tiers`` lists the tier); opening one without it raises a clear error naming
``pip install 'kvtiers[obj]'``. Adds ``kvtiers bench obj``.
"""

from __future__ import annotations

from kvtiers import hookimpl

from .tier import ObjTier

__all__ = ["ObjTier"]


@hookimpl
def register_tiers(register) -> None:
    register("obj", ObjTier)


@hookimpl
def register_commands(cli) -> None:
    from .cli import bench_obj

    bench = cli.commands.get("bench")
    if bench is not None:
        bench.add_command(bench_obj, "obj")
