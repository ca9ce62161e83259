"""The example package examples/pagedkv-spf, pip-installed as a third party would: found by its entry point alone.

The package goes into a temporary ``--target`` folder (never this environment), and each check
runs in a fresh interpreter with or without that folder on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT

REPO = ROOT
EXAMPLE = REPO / "examples" / "pagedkv-spf"

# Five requests, one at a time (max_num_seqs=1), so the completion order is the admission order.
SCRIPT = r"""
import contextlib, io, json, os, sys
from pagedkv import Engine, EngineConfig, SamplingParams
from pagedkv.cli import main as cli
from pagedkv.core.errors import ConfigError
from pagedkv.testing import tiny_llama

model = tiny_llama(num_hidden_layers=1)
lengths = [30, 5, 17, 5, 9]

def order(scheduler):
    try:
        engine = Engine(EngineConfig(device="cpu", num_blocks=32, block_size=8, max_num_seqs=1, scheduler=scheduler),
                        model=model)
    except ConfigError as exc:
        return str(exc)
    for i, n in enumerate(lengths):
        engine.add_request([1 + (i + j) % 200 for j in range(n)], SamplingParams(max_tokens=2, ignore_eos=True),
                           request_id=str(i))
    done = []
    while engine.has_unfinished():
        done += [int(out.request_id) for out in engine.step(stream=False)]
        engine.check_invariants()
    return done

def listing():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["plugins", "--json"]) == 0
    return {row["name"]: row for row in json.loads(out.getvalue())}

report = {}
for case in sys.argv[1:]:  # "default", or "disable=spf" / "only=" to set the env controls first
    key, _, value = case.partition("=")
    os.environ.pop("PAGEDKV_DISABLE_PLUGINS", None)
    os.environ.pop("PAGEDKV_PLUGINS", None)
    if key == "disable":
        os.environ["PAGEDKV_DISABLE_PLUGINS"] = value
    elif key == "only":
        os.environ["PAGEDKV_PLUGINS"] = value
    report[case] = {"fcfs": order("fcfs"), "spf": order("spf"), "plugins": listing()}
print("REPORT" + json.dumps(report))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """pip install --target of a copy of the example (a build in place would leave build/ in the repo)."""
    work = tmp_path_factory.mktemp("third_party")
    source, target = work / "src", work / "site"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return target


def run_cases(cases: list[str], tmp_path: Path, extra_path: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PAGEDKV_PLUGINS", "PAGEDKV_DISABLE_PLUGINS")}
    env["PYTHONPATH"] = str(extra_path) if extra_path else ""
    done = subprocess.run([sys.executable, "-c", SCRIPT, *cases], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("REPORT")]
    return json.loads(line[len("REPORT"):])


FCFS_ORDER = [0, 1, 2, 3, 4]
SPF_ORDER = [1, 3, 4, 2, 0]  # shortest prompt first, ties in arrival order


def test_installed_example_is_discovered_changes_admission_and_can_be_blocked(site, tmp_path):
    report = run_cases(["default", "disable=spf", "only=", "only=spf"], tmp_path, site)

    default = report["default"]
    row = default["plugins"]["spf"]  # found through the entry point alone: nothing else names it
    assert (row["distribution"], row["version"], row["status"]) == ("pagedkv-spf", "0.1.0", "loaded")
    assert row["builtin"] is False and row["hooks"] == ["pagedkv_register_schedulers"]
    assert row["module"] == "pagedkv_spf"
    assert default["plugins"]["schedulers"]["builtin"] is True
    assert default["fcfs"] == FCFS_ORDER
    assert default["spf"] == SPF_ORDER

    for case in ("disable=spf", "only="):  # blocked, or not selected: the default behaviour is back
        assert report[case]["fcfs"] == FCFS_ORDER
        assert "unknown scheduler 'spf'" in report[case]["spf"]
        assert report[case]["plugins"]["spf"]["status"] == {"disable=spf": "disabled", "only=": "not selected"}[case]
    assert report["only=spf"]["spf"] == SPF_ORDER


def test_without_the_package_on_the_path_the_default_is_back(tmp_path):
    report = run_cases(["default"], tmp_path, None)["default"]
    assert "spf" not in report["plugins"]
    assert report["fcfs"] == FCFS_ORDER
    assert report["spf"].startswith("unknown scheduler 'spf'; available: fcfs")
