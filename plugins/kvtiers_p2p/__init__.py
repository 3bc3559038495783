"""kvtiers_p2p: the ``p2p`` tier, KV chunks in other hosts' memory over ZMQ, and the peer
server (``kvtiers p2p serve``).

Registered through the ``kvtiers`` entry point ``p2p = "kvtiers_p2p"``. This module imports
without pyzmq (``kvtiers tiers`` lists the tier); opening one without it is an error naming
``pip install 'kvtiers[p2p]'``. Adds ``kvtiers p2p serve|keygen`` and ``kvtiers bench p2p``.
"""

from __future__ import annotations

from kvtiers import hookimpl

__all__ = ["P2PTier"]


def __getattr__(name: str):
    if name == "P2PTier":
        from .tier import P2PTier

        return P2PTier
    raise AttributeError(f"module 'kvtiers_p2p' has no attribute {name!r}")


@hookimpl
def register_tiers(register) -> None:
    from .tier import P2PTier  # imports without pyzmq and msgpack; opening a tier needs them

    register("p2p", P2PTier)


@hookimpl
def register_commands(cli) -> None:
    from .cli import bench_p2p, p2p

    cli.add_command(p2p)
    bench = cli.commands.get("bench")
    if bench is not None:
        bench.add_command(bench_p2p, "p2p")
