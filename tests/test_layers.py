"""The three layers a newcomer sees (docs/development.md): ``kvtiers/`` the SDK a tier author
reads, ``kvtiers/engine/`` the library an engine links against, ``kvtiers/commands/`` the
``kvtiers`` command. Data flows one way: commands use the engine and the SDK, the engine uses
the SDK; the SDK imports neither, and the engine imports no plugin (plugin features reach it
through registration hooks). Checked on the syntax trees, so an import inside a function,
which no import-time test would see, counts too. No two modules of ``kvtiers/``, ``plugins/``
or ``conformance/`` import each other, directly or round a longer circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib
from test_torch_boundary import ROOT, imports_of, module_name

SDK = ROOT / "kvtiers"
ENGINE = SDK / "engine"
COMMANDS = SDK / "commands"
PLUGIN_PACKAGES = sorted(p.name for p in (ROOT / "plugins").iterdir() if (p / "__init__.py").exists())


#: parts of the SDK layer kept in a package of their own (each counts as one module of the top level)
SDK_PACKAGES = ("compression", "encryption")


def sdk_modules() -> list[Path]:
    """The SDK layer's modules: the top level's, and those of :data:`SDK_PACKAGES`."""
    return sorted(SDK.glob("*.py")) + [p for pkg in SDK_PACKAGES for p in sorted((SDK / pkg).glob("*.py"))]


def imported(path: Path) -> list[tuple[int, str]]:
    return imports_of(path)


def test_the_sdk_top_level_is_at_most_twelve_modules_and_none_is_a_command() -> None:
    names = [p.name for p in SDK.glob("*.py")] + [f"{pkg}/" for pkg in SDK_PACKAGES]
    # about twelve: the contract and its helpers, encryption/ (the 'encrypt' option every tier
    # takes) and launcher.py (the child-process launcher for a server a conformance config starts)
    # and compression/ (the 'compress' option every tier takes)
    assert 5 <= len(names) <= 15, names
    others = sorted(p.name for p in SDK.iterdir() if (p / "__init__.py").exists()
                    and p.name not in (*SDK_PACKAGES, "engine", "commands", "integrations"))
    assert others == [], f"a package in the SDK layer that this test does not scan: {others}"
    commands = [p.name for p in sdk_modules() for _line, mod in imported(p) if mod.split(".")[0] == "click"]
    assert commands == [], f"click (a command) imported in the SDK: {commands}"
    for banned in ("cli.py", "tierbench.py", "plot.py", "progress.py", "asyncbench.py", "events_cli.py"):
        assert banned not in names


def test_the_sdk_imports_no_engine_command_integration_or_plugin() -> None:
    offenders = []
    for p in sdk_modules():
        for line, mod in imported(p):
            top = mod.split(".")[0]
            layer = ".".join(mod.split(".")[:2])
            if p.name == "__init__.py" and mod == "kvtiers.engine":
                continue  # kvtiers.TieringManager & co.: re-exported lazily, on first attribute access
            if layer in ("kvtiers.engine", "kvtiers.commands", "kvtiers.integrations") or top in PLUGIN_PACKAGES \
                    or top == "torch":
                offenders.append(f"{p.name}:{line} {mod}")
    assert offenders == [], offenders


def test_the_engine_has_no_demo_simulator_or_bench_and_imports_no_plugin_or_command() -> None:
    names = {p.stem for p in ENGINE.glob("*.py")}
    assert "manager" in names and "arena" in names, names
    assert not [n for n in names if "demo" in n or "simulat" in n or "bench" in n or n == "simmodel"], names
    offenders = [
        f"{p.relative_to(ROOT)}:{line} {mod}"
        for p in ENGINE.rglob("*.py")
        for line, mod in imported(p)
        if mod.split(".")[0] in PLUGIN_PACKAGES or mod.startswith(("kvtiers.commands", "kvtiers_conformance"))
    ]
    assert offenders == [], offenders


def test_the_scan_sees_imports_inside_functions() -> None:
    # the checks above are only as good as imports_of: build.py imports the registry inside a function
    mods = [m for _line, m in imported(ENGINE / "build.py")]
    assert "kvtiers.registry.get_registry" in mods, mods


def command_graph() -> dict[str, set[str]]:
    """Module -> the kvtiers.commands modules it imports (at any depth of the syntax tree)."""
    graph: dict[str, set[str]] = {}
    for p in COMMANDS.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(x for x in parts if x != "__init__")
        deps = set()
        for _line, mod in imported(p):
            while mod.startswith("kvtiers.commands") and mod not in graph and not _is_module(mod):
                mod = mod.rsplit(".", 1)[0]
            if mod.startswith("kvtiers.commands.") and mod != name:
                deps.add(mod)
        graph[name] = deps
    return graph


def _is_module(mod: str) -> bool:
    path = ROOT.joinpath(*mod.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (as a path that ends where it began), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node):], node]
        if node in done:
            return None
        for dep in sorted(graph.get(node, ())):
            found = visit(dep, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    for node in sorted(graph):
        found = visit(node, [])
        if found:
            return found
    return None


def test_the_commands_import_each_other_without_circles() -> None:
    graph = command_graph()
    assert "kvtiers.commands.demo.chat" in graph["kvtiers.commands.demo.command"], graph  # the scan sees edges
    assert find_circle(graph) is None, " -> ".join(find_circle(graph) or [])


def test_the_circle_check_finds_a_circle() -> None:
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set(), "c": {"b"}}) is None


def module_graph() -> dict[str, set[str]]:
    """Every shipped module of ``kvtiers/``, ``plugins/`` and ``conformance/`` (by import name)
    -> the shipped modules it imports, at any depth of its syntax tree (``from pkg import
    name`` is an edge to ``pkg.name`` where that is a module, else to ``pkg``)."""
    paths = {module_name(p): p for top in ("kvtiers", "plugins", "conformance") for p in (ROOT / top).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        deps = set()
        for _line, mod in imported(path):
            mod = mod.removeprefix("plugins.").removeprefix("conformance.")  # relative imports, resolved by path
            while mod and mod not in paths:
                mod = mod.rpartition(".")[0]
            if mod and mod != name:
                deps.add(mod)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle of ``graph`` (a strongly connected set of two or more modules), as
    one path round it that ends where it began."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            members = {stack.pop()}
            while node not in members:
                members.add(stack.pop())
            if len(members) > 1:
                found.append(find_circle({m: graph[m] & members for m in members}) or sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_module_of_kvtiers_plugins_or_conformance_is_in_an_import_circle() -> None:
    graph = module_graph()
    # the scan sees each kind of import: relative in a plugin and in a subpackage, absolute, inside a function
    assert "kvtiers_p2p.protocol" in graph["kvtiers_p2p.tier"], graph["kvtiers_p2p.tier"]
    assert "kvtiers_conformance.rules" in graph["kvtiers_conformance.checks.lookup"]
    assert "kvtiers.registry" in graph["kvtiers.engine.build"] and "kvtiers.config" in graph["kvtiers.engine.build"]
    assert "kvtiers_conformance.checks" in graph["kvtiers_conformance.catalog"]  # inside all_checks()
    found = circles(graph)
    assert found == [], "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_circles_finds_every_circle_once() -> None:
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a", "g"}, "g": set()}
    assert circles(graph) == [["a", "b", "a"], ["d", "e", "d"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_all_extra_installs_every_torch_free_extra() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (spec,) = meta["all"]
    included = set(spec.split("[", 1)[1].rstrip("]").split(","))
    # nixl needs torch; engines are the integration tests' engine deps. transformers installs without torch
    torch_free = set(meta) - {"all", "nixl", "engines"}
    assert torch_free - included == set(), f"'all' misses {sorted(torch_free - included)}"
    assert "p2p" in included and "transformers" in included


def test_every_plugin_package_is_a_tier_or_says_what_it_is() -> None:
    # a sanity check of PLUGIN_PACKAGES, which the import checks above rely on
    assert {"kvtiers_fs", "kvtiers_obj", "kvtiers_p2p"} <= set(PLUGIN_PACKAGES), PLUGIN_PACKAGES
    for name in PLUGIN_PACKAGES:
        assert ast.get_docstring(ast.parse((ROOT / "plugins" / name / "__init__.py").read_text())), name
