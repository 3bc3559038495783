"""``kvtiers bench obj``."""
import click


@click.command("obj")
def bench_obj() -> None:
    """placeholder"""
