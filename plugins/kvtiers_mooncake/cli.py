"""``kvtiers mooncake serve|master``, added through ``register_commands``."""

from __future__ import annotations

import signal
import threading

import click

from kvtiers.commands.bench.tier import Size


@click.group(name="mooncake")
def mooncake() -> None:
    """A Mooncake Store pool for the mooncake tier: contribute memory, start a master."""


@mooncake.command()
@click.option("--master", "master", required=True, metavar="HOST:PORT",
              help="master_server_address of the pool's mooncake_master.")
@click.option("--segment", type=Size(), default="1GiB", show_default=True,
              help="Memory this process contributes to the pool (e.g. 8GiB).")
@click.option("--local-hostname", default="127.0.0.1", show_default=True,
              help="The address other clients reach this one at.")
@click.option("--protocol", type=click.Choice(["tcp", "rdma"]), default="tcp", show_default=True)
@click.option("--device-name", default="", help="RDMA device(s), e.g. mlx5_0.")
@click.option("--metadata-server", default="P2PHANDSHAKE", show_default=True)
def serve(master: str, segment: int, local_hostname: str, protocol: str, device_name: str,
          metadata_server: str) -> None:
    """Contribute memory to a pool and nothing else (as Mooncake's store service does), so
    engine clients run with global_segment_size 0 and an engine restart loses nothing.
    Runs until Ctrl-C / SIGTERM, then unmounts its segment (its objects leave the pool)."""
    from .serve import serve as run

    if segment <= 0:
        raise click.BadParameter("must be > 0 (a serve process only contributes memory)", param_hint="--segment")
    rc = run(master, segment, local_hostname=local_hostname, protocol=protocol, device_name=device_name,
             metadata_server=metadata_server)
    if rc:
        raise click.exceptions.Exit(rc)


@mooncake.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the master binds (RPC and metrics).")
@click.option("--port", type=int, default=0, help="RPC port (0: a free one, printed).")
@click.option("--metrics-port", type=int, default=0, help="Metrics port (0: a free one).")
@click.option("--client-ttl", type=float, default=None, help="Seconds a silent client stays alive (master default).")
@click.option("--lease-ttl", type=int, default=None, help="default_kv_lease_ttl in ms (master default).")
def master(host: str, port: int, metrics_port: int, client_ttl: float | None, lease_ttl: int | None) -> None:
    """Start a real mooncake_master (for tests and demos), print its address, and stop it by
    its own PID on Ctrl-C / SIGTERM."""
    from .master import start_master

    m = start_master(host=host, rpc_port=port, metrics_port=metrics_port, client_ttl=client_ttl,
                     default_kv_lease_ttl=lease_ttl)
    click.echo(f"mooncake_master pid {m.pid} at {m.address} (metrics {m.host}:{m.metrics_port})")
    click.echo(f'tier options: {{"type": "mooncake", "master_server_address": "{m.address}"}}')
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        if not m.alive():
            raise click.ClickException(f"mooncake_master exited with status {m.proc.returncode}")
    m.stop()
