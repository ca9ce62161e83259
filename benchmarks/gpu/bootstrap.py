"""Make ``import pagedkv`` and its entry points work even where ``pip install -e .`` failed (an old setuptools,
no setuptools at all): a temporary folder with a ``pagedkv`` link to the checkout and a minimal ``.dist-info``
whose ``entry_points.txt`` is read from ``pyproject.toml``, put first on ``sys.path`` and ``PYTHONPATH`` so
every child process sees the same."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import tempfile
from pathlib import Path


def installed_here(repo: Path) -> bool:
    """True when ``pagedkv`` imports from ``repo`` and its built-in backends are registered as entry points."""
    try:
        spec = importlib.util.find_spec("pagedkv")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    if Path(next(iter(spec.submodule_search_locations))).resolve() != repo.resolve():
        return False
    return any(ep.name == "torch" for ep in importlib.metadata.entry_points(group="pagedkv"))


def bootstrap(repo: Path) -> str | None:
    """Nothing when the checkout is installed; otherwise the shim described above. Returns a line to print."""
    if installed_here(repo):
        return None
    try:
        import tomllib
    except ImportError:  # Python 3.10: no TOML reader in the standard library
        return "pagedkv is not installed from this checkout and Python < 3.11 cannot read pyproject.toml: install it"
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    root = Path(tempfile.mkdtemp(prefix="pagedkv_shim_"))
    (root / "pagedkv").symlink_to(repo.resolve(), target_is_directory=True)
    info = root / f"pagedkv-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: pagedkv\nVersion: {project['version']}\n")
    groups = project.get("entry-points", {})
    if "scripts" in project:
        groups = {"console_scripts": project["scripts"], **groups}
    text = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items())
    (info / "entry_points.txt").write_text(text)
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    importlib.invalidate_caches()
    return f"pagedkv was not installed from this checkout: using a shim at {root} (import path + entry points)"
