"""``kvtiers new``: scaffolds for third-party plugin distributions.

:func:`new_tier` writes a complete tier distribution — ``pyproject.toml`` with the
``kvtiers`` entry point, a tier on :class:`kvtiers.AsyncTier` (one checksummed file per
chunk, a ``max_bytes`` bound that reports evictions with ``AsyncTier.evicted``,
``conformance_config`` and ``conformance_corrupt``), a ``TierTests`` subclass, a README and
a Makefile whose ``make test`` runs the conformance suite (strict) right away, and a
``.gitignore``. The file texts are in
:mod:`kvtiers.commands.new.tier_files`.
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .tier_files import FILES

NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


@dataclass(frozen=True)
class TierNames:
    """The names a tier called ``name`` goes by."""

    name: str  #: the registered tier type, e.g. ``demo_tier``
    dist: str  #: the distribution, e.g. ``kvtiers-demo-tier``
    package: str  #: the import package, e.g. ``kvtiers_demo_tier``
    cls: str  #: the tier class, e.g. ``DemoTier``

    @classmethod
    def of(cls, name: str) -> TierNames:
        if not NAME.match(name) or name.endswith("_") or "__" in name:
            raise ValueError(f"tier name {name!r}: use lower-case letters, digits and single underscores, "
                             "starting with a letter (it is the type a config names, e.g. demo_tier)")
        camel = "".join(part.capitalize() for part in name.split("_"))
        return cls(name, "kvtiers-" + name.replace("_", "-"), "kvtiers_" + name,
                   camel if camel.endswith("Tier") else camel + "Tier")


def new_tier(name: str, directory: str | Path = ".") -> Path:
    """Write the distribution of a tier called ``name`` into ``directory/kvtiers-<name>``
    and return that path. Nothing in it names this machine's paths: the Makefile's
    ``PYTHON`` defaults to ``python3`` on ``PATH`` (:func:`make_test_hint` says when that is
    not this interpreter). Raises ``ValueError`` for a bad name or a target that exists and
    is not empty."""
    names = TierNames.of(name)
    root = Path(directory, names.dist)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ValueError(f"{root} exists and is not an empty directory")
    tokens = {
        "__NAME__": names.name, "__DIST__": names.dist, "__PKG__": names.package, "__CLASS__": names.cls,
    }
    for rel, text in FILES.items():
        for token, value in tokens.items():
            rel = rel.replace(token, value)
            text = text.replace(token, value)
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def make_test_hint(root: Path) -> str:
    """The command that runs the new tier's tests: ``make test``, with ``PYTHON=`` this
    interpreter when ``python3`` on ``PATH`` is another one (e.g. a venv not activated)."""
    found = shutil.which("python3")
    same = found is not None and Path(found).parent == Path(sys.executable).parent
    return f"cd {root} && make test" + ("" if same else f" PYTHON={sys.executable}")
