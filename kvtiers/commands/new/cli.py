"""``kvtiers new tier NAME [--dir D]``: scaffold a third-party tier distribution."""

from __future__ import annotations

import click

from . import make_test_hint, new_tier


@click.group(name="new")
def new() -> None:
    """Scaffold a new plugin distribution."""


@new.command(name="tier")
@click.argument("name")
@click.option("--dir", "directory", default=".", show_default=True, type=click.Path(file_okay=False),
              help="Where to create the kvtiers-NAME directory.")
def tier(name: str, directory: str) -> None:
    """Create kvtiers-NAME/: a tier NAME on AsyncTier (files with checksums, max_bytes with
    reported evictions), its pyproject.toml entry point, a TierTests suite, a README, a
    .gitignore and a Makefile. `make test` in it runs the conformance suite (core, bounded,
    strict) at once, installing pytest first if the interpreter lacks it."""
    try:
        root = new_tier(name, directory)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        click.echo(f"created {path}")
    click.echo(f"next: {make_test_hint(root)}")
