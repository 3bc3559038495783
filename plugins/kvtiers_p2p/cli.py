"""``kvtiers p2p serve|keygen`` and ``kvtiers bench p2p``, added through ``register_commands``."""

from __future__ import annotations

import json

import click

from kvtiers.commands.bench.tier import Size


@click.group(name="p2p")
def p2p() -> None:
    """Peer caches for the p2p tier: serve one, make CurveZMQ keys."""


@p2p.command()
@click.option("--bind", default="tcp://127.0.0.1:5710", show_default=True,
              help="Address to serve on. Off loopback it needs --curve-secret and --allow.")
@click.option("--capacity", type=Size(), default="1GiB", show_default=True, help="Host memory for chunks (LRU).")
@click.option("--namespace", help="Serve only this namespace digest (default: any).")
@click.option("--chunk-bytes", type=int, help="Serve only chunks of this size (default: fixed per namespace by "
                                              "its first client).")
@click.option("--max-clients", type=click.IntRange(1), default=64, show_default=True)
@click.option("--max-inflight", type=click.IntRange(1), default=16, show_default=True,
              help="GET requests in flight per client.")
@click.option("--max-chunk-bytes", type=Size(), default="64MiB", show_default=True,
              help="Largest chunk; a bigger frame disconnects its sender.")
@click.option("--handshake-timeout", type=click.FloatRange(min=0.1), default=5.0, show_default=True)
@click.option("--idle-timeout", type=click.FloatRange(min=1), default=300.0, show_default=True)
@click.option("--max-connections", type=click.IntRange(1), default=256, show_default=True,
              help="Connections at once; more are closed at once, and one without HELLO after --handshake-timeout.")
@click.option("--max-sessions-per-peer", type=click.IntRange(1), default=32, show_default=True,
              help="Sessions of one peer at once (its address; its client key with CurveZMQ).")
@click.option("--max-pending-per-peer", type=click.IntRange(1), default=16, show_default=True,
              help="Connections that have not said HELLO from one address at once; one more is closed at once.")
@click.option("--max-namespaces-per-peer", type=click.IntRange(1), default=32, show_default=True,
              help="Namespaces charged to one peer (the first to say HELLO for each); at the cap its least "
                   "recently used namespace no session uses is reclaimed for a new one.")
@click.option("--max-chunk-sizes-per-peer", type=click.IntRange(1), default=4, show_default=True,
              help="Distinct chunk sizes of the namespaces charged to one peer (of 8 on the server).")
@click.option("--stall-timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds a client may read nothing while replies wait for it before it is disconnected.")
@click.option("--curve-secret", type=click.Path(dir_okay=False), help="The server's secret key file (CurveZMQ).")
@click.option("--allow", "allow_dir", type=click.Path(),
              help="CurveZMQ: a directory of allowed clients' public key files (any namespace), or an allowlist "
                   "file binding each client key to its namespaces (docs/p2p-security.md).")
@click.option("--nixl", is_flag=True, help="Also serve loads over NIXL (UCX) to clients with backend 'nixl'.")
@click.option("--nixl-strict", is_flag=True,
              help="With --nixl: refuse to start if NIXL's canary crashes or hangs (default: serve over ZMQ only, "
                   "with a warning).")
@click.option("--test-faults", is_flag=True,
              help="Tests only: accept CORRUPT requests that damage stored chunks (conformance rule 4).")
@click.option("--endpoint-file", hidden=True)
@click.option("--exit-when-missing", hidden=True)
@click.option("--parent-pid", type=int, hidden=True)
def serve(bind: str, capacity: int, namespace: str | None, chunk_bytes: int | None, max_clients: int,
          max_inflight: int, max_chunk_bytes: int, handshake_timeout: float, idle_timeout: float,
          max_connections: int, max_sessions_per_peer: int, max_pending_per_peer: int,
          max_namespaces_per_peer: int, max_chunk_sizes_per_peer: int, stall_timeout: float,
          curve_secret: str | None, allow_dir: str | None, nixl: bool,
          nixl_strict: bool, test_faults: bool, endpoint_file: str | None, exit_when_missing: str | None,
          parent_pid: int | None) -> None:  # fmt: skip
    """Run a standalone peer cache in host memory until SIGTERM or Ctrl-C."""
    from kvtiers.commands.requires import require

    require("kvtiers p2p serve", "zmq", "msgpack")
    from .server import AuthConfigError, ServerLimits, run

    limits = ServerLimits(max_clients=max_clients, max_inflight=max_inflight, max_chunk_bytes=max_chunk_bytes,
                          handshake_timeout=handshake_timeout, idle_timeout=idle_timeout,
                          max_connections=max_connections, stall_timeout=stall_timeout,
                          max_sessions_per_peer=max_sessions_per_peer, max_pending_per_peer=max_pending_per_peer,
                          max_namespaces_per_peer=max_namespaces_per_peer,
                          max_chunk_sizes_per_peer=max_chunk_sizes_per_peer)

    if nixl:  # NIXL's canary first: if it crashes, serve over ZMQ only (or, strict, refuse)
        from kvtiers_nixl import use_nixl

        from kvtiers import TierError

        try:
            nixl = use_nixl("p2p server", fallback="ZMQ", strict=nixl_strict)
        except TierError as e:
            raise click.ClickException(str(e)) from None

    def announce(server) -> None:
        if endpoint_file is None:
            click.echo(f"kvtiers p2p: serving on {server.endpoint}, capacity {capacity} bytes", err=True)

    try:
        stats = run(bind, capacity, limits=limits, namespace=namespace, chunk_bytes=chunk_bytes,
                    curve_secret=curve_secret, allow_dir=allow_dir, endpoint_file=endpoint_file,
                    exit_when_missing=exit_when_missing, parent_pid=parent_pid, announce=announce, nixl=nixl,
                    test_faults=test_faults)
    except (AuthConfigError, ValueError, RuntimeError, ImportError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"kvtiers p2p: stopped; stats {json.dumps(stats, sort_keys=True)}", err=True)


@p2p.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="server", show_default=True, help="Base name of the key files.")
@click.option("--force", is_flag=True, help="Replace an existing key pair of that name.")
@click.option("--allow", "allowlist", type=click.Path(dir_okay=False),
              help="Add the new public key to this allowlist file (serve --allow FILE) with --namespace.")
@click.option("--namespace", "namespaces", multiple=True,
              help="A namespace digest the key may use (repeatable; '*': any). Needs --allow.")
def keygen(directory: str, name: str, force: bool, allowlist: str | None, namespaces: tuple[str, ...]) -> None:
    """Make a CurveZMQ key pair in DIRECTORY: NAME.key (public, give it to the other side)
    and NAME.key_secret (keep it private; created readable by its owner only)."""
    from kvtiers.commands.requires import require

    require("kvtiers p2p keygen", "zmq")
    from .tenants import AllowlistError, add_to_allowlist, write_key_pair

    if bool(allowlist) != bool(namespaces):
        raise click.UsageError("--allow FILE and --namespace go together")
    try:
        public, secret = write_key_pair(directory, name, force=force)
        if allowlist:
            add_to_allowlist(allowlist, public, list(namespaces))
    except (FileExistsError, AllowlistError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"public key: {public}\nsecret key: {secret}")
    if allowlist:
        click.echo(f"allowed in {allowlist}: {', '.join(namespaces)}")


# `kvtiers bench p2p`: the one tier-bench harness with the tier fixed (kvtiers.commands.bench.harness)
from .bench import bench_p2p  # noqa: E402, F401
