"""The built-in plugins use only the declared plugin API: they never set an attribute of an object
that is not their own, nor read a private attribute of another object (docs/plugins.md).

A static check of assignments and private reads: a mutating method call on another object's
public attribute (``allocator.pending_copies.append(...)``) is not caught here; the per-plugin
tests and review cover that."""

from __future__ import annotations

import ast

import pytest
from repo_paths import ROOT

PLUGINS = ROOT / "plugins"
BUILT_IN = ["prefix_cache.py", "copy_on_write.py", "cpu_swap.py", "telemetry.py"]


def violations(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, (ast.Attribute, ast.Subscript)) and isinstance(sub.ctx, ast.Store):
                    base = sub.value
                    if isinstance(sub, ast.Subscript) and isinstance(base, ast.Attribute):
                        base = base.value  # obj.attr[i] = ... writes into obj's attribute
                    if not (isinstance(base, ast.Name) and base.id in ("self", "cls")) and not (
                        isinstance(sub, ast.Subscript) and isinstance(base, ast.Name)  # a local container
                    ):
                        found.append(f"line {node.lineno}: writes {ast.unparse(sub)}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"line {node.lineno}: reads {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("name", BUILT_IN)
def test_a_built_in_plugin_touches_the_core_only_through_the_declared_api(name):
    assert violations((PLUGINS / name).read_text()) == []


def test_the_check_catches_what_the_old_plugins_did():
    old = (
        "def f(engine, allocator, seq, old, new):\n"
        "    engine.scheduler.swapper = engine\n"
        "    engine.runner.cpu_kv_caches = []\n"
        "    allocator.pending_copies.append((old, new))\n"
        "    seq.block_table.blocks[0] = new\n"
        "    return engine._computed_running()\n"
    )
    assert [v.split(":")[0] for v in violations(old)] == ["line 2", "line 3", "line 5", "line 6"]
