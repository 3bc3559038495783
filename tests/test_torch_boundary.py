"""The torch boundary is a folder boundary: ``kvtiers/engine/`` (the engine library) and the
engine bridges under ``kvtiers/integrations/<engine>/`` import torch; the commands
(``kvtiers/commands/``) that need it (the demos, ``bench arena``, the tiny model maker)
import it inside functions only, so every command module imports without torch and
``kvtiers --help`` works where torch is absent.

Tier authors read and install everything else (the contract, the SDK, the first-party tiers,
the conformance suite, the example tier) without torch. The check reads every shipped module's
syntax tree, so an ``import torch`` inside a function, which no import-time test would see,
still fails it. The bridges run inside vLLM or SGLang, which bring torch, and address SGLang's
host pool through torch tensors; so they may import torch (and their engine), but
``kvtiers.integrations`` itself and its shared helpers may not, and nothing outside
``kvtiers/integrations/`` imports them: engines call into kvtiers, never the other way.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from test_no_torch import BLOCKER

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ["kvtiers", "plugins", "conformance", "examples"]
ENGINE = ROOT / "kvtiers" / "engine"
INTEGRATIONS = ROOT / "kvtiers" / "integrations"
COMMANDS = ROOT / "kvtiers" / "commands"


def may_import_torch(path: Path) -> bool:
    """``kvtiers/engine/`` and the per-engine bridges ``kvtiers/integrations/<engine>/``."""
    return ENGINE in path.parents or (INTEGRATIONS in path.parents and path.parent != INTEGRATIONS)


def may_import_torch_in_functions(path: Path) -> bool:
    """The commands: torch inside a function body, never at import time."""
    return COMMANDS in path.parents


def _is_torch_import(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
    else:
        return False
    return any(n == "torch" or n.startswith("torch.") for n in names)


def torch_imports(path: Path) -> list[int]:
    """Line numbers of every ``import torch...`` / ``from torch... import`` in ``path``."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text(), str(path))) if _is_torch_import(node)]


def shipped_modules() -> list[Path]:
    return sorted(p for d in SHIPPED for p in (ROOT / d).rglob("*.py") if "tests" not in p.parts)


def test_the_scan_sees_torch_imports() -> None:
    # the engine does import torch, inside functions: a scan that finds none there is broken
    found = {p.name for p in ENGINE.glob("*.py") if torch_imports(p)}
    assert {"dma.py", "arena.py"} <= found, found


def module_level_torch_imports(path: Path) -> list[int]:
    """Line numbers of torch imports that run at import time (not inside a function)."""
    tree = ast.parse(path.read_text(), str(path))
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    return [node.lineno for node in ast.walk(tree) if id(node) not in inside and _is_torch_import(node)]


def test_nothing_outside_kvtiers_engine_imports_torch() -> None:
    offenders = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in shipped_modules()
        if not may_import_torch(p) and not may_import_torch_in_functions(p)
        for line in torch_imports(p)
    ]
    assert offenders == [], f"torch imported outside kvtiers/engine/ and kvtiers/integrations/<engine>/: {offenders}"


def test_commands_import_torch_only_inside_functions() -> None:
    found = {p.relative_to(COMMANDS).as_posix() for p in COMMANDS.rglob("*.py") if torch_imports(p)}
    assert "demo/engine.py" in found, found  # the scan sees the demo's torch: a scan that finds none is broken
    offenders = [f"{p.relative_to(ROOT)}:{line}"
                 for p in COMMANDS.rglob("*.py") for line in module_level_torch_imports(p)]
    assert offenders == [], f"torch imported at module level in a command: {offenders}"


def test_the_module_level_scan_tells_functions_apart(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text("import os\n\ndef f():\n    import torch\n\nimport torch.nn\n")
    assert sorted(torch_imports(mod)) == [4, 6] and module_level_torch_imports(mod) == [6]


def test_the_rule_for_integrations() -> None:
    assert may_import_torch(INTEGRATIONS / "vllm" / "tier.py")
    assert may_import_torch(INTEGRATIONS / "sglang" / "backend.py")
    assert not may_import_torch(INTEGRATIONS / "__init__.py")
    assert not may_import_torch(INTEGRATIONS / "keys.py")


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative ones resolved."""
    pkg = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(pkg[: len(pkg) - node.level + 1]) if node.level else []
            mod = ".".join([*base, node.module] if node.module else base)
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def test_only_the_integrations_import_the_integrations() -> None:
    offenders = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in shipped_modules()
        if INTEGRATIONS not in p.parents and COMMANDS not in p.parents  # the command may demo one
        for line, mod in imports_of(p)
        if mod.startswith("kvtiers.integrations")
    ]
    assert offenders == [], f"kvtiers.integrations imported from outside it: {offenders}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] in ("plugins", "conformance"):  # installed as top-level packages
        parts = parts[1:]
    return ".".join(p for p in parts if p != "__init__")


def test_every_module_outside_the_engine_imports_without_torch() -> None:
    names = [
        module_name(p)
        for p in shipped_modules()
        if not may_import_torch(p) and p.name != "__main__.py" and "examples" not in p.parts
    ]
    assert "kvtiers.commands.cli" in names and "kvtiers_fs.tier" in names and "kvtiers_conformance" in names, names
    assert "kvtiers.integrations.keys" in names and "kvtiers.integrations.vllm.tier" not in names, names
    code = BLOCKER + f"import importlib\nnames = {names!r}\nfor n in names:\n    importlib.import_module(n)\n"
    code += "print('imported', len(names))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"imported {len(names)}"
