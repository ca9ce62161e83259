"""The package's import graph has no cycles, the top-level packages import only downward, and core's
rooms too.

Every module's imports are read with ``ast`` (function-level imports included; those under
``if TYPE_CHECKING:`` never run and are left out), so a cycle hidden in a lazy import
inside a function is caught too.

The top-level layers, highest first (``LAYERS``), as the README's layout draws them:

- ``cli``: the ``engine`` command, composing everything below it;
- ``serve``, ``monitor``, ``sim``: what a subcommand runs (the HTTP server, the dashboard, the simulator);
- ``backends``, ``plugins``: the engine's extensions (attention kernels; prefix cache, swap, telemetry, ...);
- the package root (``pagedkv``: the version and a lazy facade over core; ``pagedkv.testing``);
- ``core``: the engine, which imports nothing above it.

A package may import its own modules and any lower layer, never a higher one, and never a peer on its own
layer: serve, monitor and sim know nothing of one another, nor backends and plugins (the graph today has
no such edge; monitor and serve do use plugins, the telemetry address and its close, which is downward).
"""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib
from repo_paths import ROOT

ABOVE_CORE = ("pagedkv.cli", "pagedkv.monitor", "pagedkv.plugins", "pagedkv.serve", "pagedkv.sim")
# the top-level packages, highest layer first; "pagedkv" stands for the root's own modules (__init__, testing)
LAYERS = (("cli",), ("serve", "monitor", "sim"), ("backends", "plugins"), ("pagedkv",), ("core",))
# core's rooms, lowest first: each may import itself, the rooms before it and the foundation modules
ROOMS = ("plugin", "kv", "sample", "sched", "model", "dist")
FOUNDATION = {f"pagedkv.core.{m}" for m in ("errors", "limits", "events", "stats", "config", "hookspecs",
                                                   "startup_phases")}


def package_modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every package pyproject maps (``[tool.setuptools.package-dir]``)."""
    dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules: dict[str, Path] = {}
    for package, folder in dirs.items():
        base = root / folder
        for path in base.glob("*.py") if package == "pagedkv" else base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("").parts
            name = ".".join((package, *rel))
            modules[name.removesuffix(".__init__")] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its body."""

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    found: set[str] = set()
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(resolve(a.name) for a in node.names if a.name.startswith("pagedkv"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            if base.startswith("pagedkv"):
                for alias in node.names:  # ``from pagedkv.core import engine`` imports the module engine
                    full = f"{base}.{alias.name}"
                    found.add(resolve(full) if full in modules else resolve(base))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {m for m in found if m is not None and m != name}


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = package_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph(ROOT)
    assert len(graph) > 60 and "pagedkv.cli.main" in graph and "pagedkv.sim.simulate" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_core_imports_nothing_above_it():
    graph = import_graph(ROOT)
    reaching = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith("pagedkv.core")
                      for t in targets if t.startswith(ABOVE_CORE))
    assert reaching == []


def package_of(module: str) -> str:
    """The top-level package a module belongs to (``serve``, ``core``, ...), ``"pagedkv"`` for the root's own."""
    parts = module.split(".")
    known = {package for layer in LAYERS for package in layer}
    return parts[1] if len(parts) > 1 and parts[1] in known else "pagedkv"


def upward_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a higher layer's module, or of a peer package's on the same layer."""
    layer = {package: i for i, packages in enumerate(LAYERS) for package in packages}
    bad = []
    for module, targets in graph.items():
        src = package_of(module)
        for target in targets:
            dst = package_of(target)
            if dst != src and layer[dst] <= layer[src]:
                kind = "peer" if layer[dst] == layer[src] else "upward"
                bad.append(f"{module} ({src}) -> {target} ({dst}): {kind}")
    return sorted(bad)


def test_top_level_packages_import_only_downward():
    graph = import_graph(ROOT)
    assert {package_of(m) for m in graph} == {package for layer in LAYERS for package in layer}
    assert upward_violations(graph) == []


def test_an_upward_or_peer_import_between_packages_is_found():
    """The check itself: serve importing cli, a plugin importing serve, core importing the root, sim importing
    serve (peers) are each reported; cli importing serve and serve importing plugins or core are not."""
    graph = {"pagedkv.serve.server": {"pagedkv.cli.engine_args", "pagedkv.plugins.telemetry", "pagedkv.core.engine"},
             "pagedkv.plugins.telemetry": {"pagedkv.serve.metrics", "pagedkv.core.hookspecs"},
             "pagedkv.core.engine": {"pagedkv"},
             "pagedkv.sim.simulate": {"pagedkv.serve.server"},
             "pagedkv.cli.serve": {"pagedkv.serve.server", "pagedkv.testing"},
             "pagedkv.testing": {"pagedkv.core.engine"}}
    assert upward_violations(graph) == [
        "pagedkv.core.engine (core) -> pagedkv (pagedkv): upward",
        "pagedkv.plugins.telemetry (plugins) -> pagedkv.serve.metrics (serve): upward",
        "pagedkv.serve.server (serve) -> pagedkv.cli.engine_args (cli): upward",
        "pagedkv.sim.simulate (sim) -> pagedkv.serve.server (serve): peer",
    ]


def room_of(module: str) -> str | None:
    """The core room a module lives in (``kv``, ``sched``, ...), ``"foundation"``, ``"top"``, or None outside core."""
    if module in FOUNDATION:
        return "foundation"
    parts = module.split(".")
    if parts[:2] != ["pagedkv", "core"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in ROOMS else "top"


def downward_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a core room to a room above it (or from a foundation module to any room)."""
    rank = {room: i for i, room in enumerate(ROOMS)}
    bad = []
    for module, targets in graph.items():
        src = room_of(module)
        if src in (None, "top"):
            continue
        for target in targets:
            if not target.startswith("pagedkv.core"):
                continue
            dst = room_of(target)
            allowed = dst == "foundation" or (src != "foundation" and dst in rank and rank[dst] <= rank[src])
            if not allowed:
                bad.append(f"{module} ({src}) -> {target} ({dst})")
    return sorted(bad)


def test_core_rooms_import_only_downward():
    """kv and sample know nothing of sched; sched knows kv and sample; only the top of core knows every room."""
    graph = import_graph(ROOT)
    assert {room_of(m) for m in graph} >= {*ROOMS, "foundation", "top"}
    assert downward_violations(graph) == []


def test_an_upward_import_between_rooms_is_found():
    """The check itself: kv importing sched, or a foundation module importing a room, is reported."""
    graph = {"pagedkv.core.kv.allocator": {"pagedkv.core.sched.sequence", "pagedkv.core.errors"},
             "pagedkv.core.errors": {"pagedkv.core.kv.block_pool"},
             "pagedkv.core.sched.scheduler": {"pagedkv.core.kv.block_pool", "pagedkv.core.engine"},
             "pagedkv.core.engine": {"pagedkv.core.dist.tp_runner"}}
    assert downward_violations(graph) == [
        "pagedkv.core.errors (foundation) -> pagedkv.core.kv.block_pool (kv)",
        "pagedkv.core.kv.allocator (kv) -> pagedkv.core.sched.sequence (sched)",
        "pagedkv.core.sched.scheduler (sched) -> pagedkv.core.engine (top)",
    ]


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    """The check itself: a lazy import inside a function closing a loop must be reported."""
    dirs = '[tool.setuptools.package-dir]\n"pagedkv" = "."\n"pagedkv.core" = "core"\n'
    (tmp_path / "pyproject.toml").write_text(dirs)
    (tmp_path / "__init__.py").write_text("")
    core = tmp_path / "core"
    core.mkdir()
    (core / "__init__.py").write_text("")
    (core / "a.py").write_text("from pagedkv.core.b import thing\n")
    (core / "b.py").write_text("def thing():\n    from pagedkv.core import a\n    return a\n")
    (core / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedkv.core import a\n")
    graph = import_graph(tmp_path)
    assert graph["pagedkv.core.c"] == set()  # type-checking imports never run
    assert find_cycle(graph) == ["pagedkv.core.a", "pagedkv.core.b", "pagedkv.core.a"]
