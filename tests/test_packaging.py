"""One import root, lazy heavy imports, entry points: the package as a user installs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT

REPO = ROOT


def run_python(code: str, cwd: Path, env_path: str | None = None) -> str:
    import os

    env = dict(os.environ)
    if env_path is not None:
        env["PYTHONPATH"] = env_path
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_installed_package_imports_from_outside_the_repo(tmp_path):
    out = run_python(
        "import importlib.util, json, pagedkv, pagedkv.core, pagedkv.backends, pagedkv.plugins, pagedkv.monitor;"
        "print(json.dumps({'file': pagedkv.__file__,"
        " 'stray': [m for m in ('core', 'backends', 'plugins', 'monitor') if importlib.util.find_spec(m)]}))",
        cwd=tmp_path,
    )
    info = json.loads(out)
    assert info["stray"] == [], "a top-level core/backends/plugins/monitor module is installed"


def test_core_does_not_import_heavy_frameworks(tmp_path):
    out = run_python(
        "import sys, pagedkv.core.engine, pagedkv.cli.main, pagedkv.core.plugin.plugin_manager as p;"
        "pm = p.make_plugin_manager(); p.build_registry(pm, 'backend', 'pagedkv_register_backends');"
        "print(sorted(m for m in ('triton', 'cupy', 'textual') if m in sys.modules))",
        cwd=tmp_path,
    )
    assert out.strip() == "[]"


def test_builtin_components_come_through_the_entry_point_group(tmp_path):
    out = run_python(
        "import json, pagedkv.core.plugin.plugin_manager as p; pm = p.make_plugin_manager();"
        "print(json.dumps({k: p.build_registry(pm, k, h).names() for k, h in ["
        "('backend', 'pagedkv_register_backends'), ('allocator', 'pagedkv_register_allocators'),"
        "('scheduler', 'pagedkv_register_schedulers')]}))",
        cwd=tmp_path,
    )
    assert json.loads(out) == {
        "backend": ["cpu", "cupy", "torch", "triton"],
        "allocator": ["paged", "static"],
        "scheduler": ["fcfs", "priority"],
    }


@pytest.mark.slow
def test_regular_wheel_install_works_from_outside_the_repo(tmp_path):
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir),
         str(REPO)],
        check=True, capture_output=True, timeout=300,
    )
    wheel = next(wheel_dir.glob("pagedkv-*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )
    top_level = sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info"))
    assert top_level == ["bin", "pagedkv"] or top_level == ["pagedkv"]
    assert (target / "pagedkv" / "backends" / "cupy").is_dir()
    out = run_python(
        "import pagedkv, pagedkv.core.engine, pagedkv.backends.torch_ref; print(pagedkv.__file__)",
        cwd=tmp_path, env_path=str(target),
    )
    assert out.strip().startswith(str(target))
