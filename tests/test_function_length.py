"""No product function is over 80 lines: a long function is split into named steps (tests, benchmarks and the
example plugin are not product code)."""

from __future__ import annotations

import ast

from repo_paths import ROOT

LIMIT = 80
NOT_PRODUCT = {"tests", "benchmarks", "examples", "build", "docs"}


def long_functions(root=ROOT, limit: int = LIMIT) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in NOT_PRODUCT or any(part.startswith(".") for part in rel.parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_product_function_is_over_80_lines():
    assert long_functions() == []


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text(f"def too_long():\n{body}\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_long.py").write_text(f"def test_long():\n{body}\n")
    assert long_functions(tmp_path) == ["pkg/long.py:1 too_long (81 lines)"]
