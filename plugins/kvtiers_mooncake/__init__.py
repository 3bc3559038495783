"""kvtiers_mooncake: the ``mooncake`` tier, a cluster-wide KV pool on Mooncake Store.

Registered through the ``kvtiers`` entry point. This module imports without Mooncake
(``kvtiers tiers`` lists the tier and says what is missing); opening one without it raises
a clear error naming ``pip install 'kvtiers[mooncake]'`` or the system library
``libibverbs1``. Adds ``kvtiers mooncake serve|master``.
"""

from __future__ import annotations

from kvtiers import hookimpl

from .tier import MooncakeTier

__all__ = ["MooncakeTier"]


@hookimpl
def register_tiers(register) -> None:
    register("mooncake", MooncakeTier)


@hookimpl
def register_commands(cli) -> None:
    from .cli import mooncake

    cli.add_command(mooncake, "mooncake")
