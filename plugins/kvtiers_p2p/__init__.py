"""kvtiers_p2p: the ``p2p`` tier, KV chunks in other hosts' memory over ZMQ, and the peer
server (``kvtiers p2p serve``).

Registered through the ``kvtiers`` entry point ``p2p = "kvtiers_p2p"``. This module imports
without pyzmq (``kvtiers tiers`` lists the tier); opening one without it is an error naming
``pip install 'kvtiers[p2p]'``. Adds ``kvtiers p2p serve|keygen`` and ``kvtiers bench p2p``, and the
engine's ``serve`` config block (peers read a manager's host cache; docs/p2p.md).
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


def _attach_serve(manager, block):
    """The ``serve`` block: serve ``manager``'s host cache to peers (docs/p2p.md)."""
    from kvtiers.errors import ConfigError

    try:
        from .engine_serve import serve_arena
    except ImportError as e:
        raise ConfigError(f"config: 'serve' needs the p2p tier's packages: pip install 'kvtiers[p2p]' ({e})") from None
    return serve_arena(manager, block)


@hookimpl
def register_manager_blocks(register) -> None:
    register("serve", _attach_serve)
