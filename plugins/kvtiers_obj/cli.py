"""``kvtiers bench obj``: the obj tier against plain aiobotocore on the same server."""

from __future__ import annotations

import json

import click

from kvtiers.config import parse_json_option


@click.command("obj")
@click.option("--config", "config_text", help='Tier options as JSON, e.g. \'{"endpoint_url": URL, "bucket": B}\'.')
@click.option("--config-file", type=click.Path(dir_okay=False), help="Tier options from a JSON file.")
@click.option("--chunk-bytes", type=int, default=4 << 20, show_default=True, help="Bytes per chunk (multiple of 4096).")
@click.option("--chunks", type=int, default=16, show_default=True, help="Chunks per round (64 MiB at the defaults).")
@click.option("--rounds", type=int, default=3, show_default=True, help="Interleaved rounds; medians are compared.")
@click.option("--backend", type=click.Choice(["config", "aiobotocore", "nixl", "both"]), default="config",
              show_default=True, help="Tier backend(s) to measure; 'both' runs aiobotocore and nixl in one run.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def bench_obj(config_text: str | None, config_file: str | None, chunk_bytes: int, chunks: int, rounds: int,
              backend: str, as_json: bool) -> None:  # fmt: skip
    """Store and load throughput of the obj tier against plain aiobotocore put/get of the
    same sizes at the same concurrency, on the same server, in one run."""
    from .bench import format_table, run_bench

    config = parse_json_option(config_text, config_file)
    config.pop("type", None)
    if not config:
        raise click.UsageError('give --config \'{"endpoint_url": URL, "bucket": B, ...}\' or --config-file')
    try:
        backends = {"config": None, "both": ["aiobotocore", "nixl"]}.get(backend, [backend])
        report = run_bench(config, chunk_bytes=chunk_bytes, chunks=chunks, rounds=rounds, backends=backends)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(json.dumps(report, indent=1) if as_json else format_table(report))
