"""PAGEDKV_PLUGINS / PAGEDKV_DISABLE_PLUGINS, broken plugins, and the plugin listing (``engine plugins``).

Third-party plugins here are real installed distributions, only tiny: a ``*.dist-info`` folder
with an ``entry_points.txt`` and a module, in a temporary folder put on ``sys.path``.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys

import pytest

from pagedkv.cli import main as cli
from pagedkv.core.errors import ConfigError
from pagedkv.core.plugin.plugin_manager import build_registry, list_plugins, make_plugin_manager

_unique = itertools.count()

GOOD = '''
from pagedkv.core.hookspecs import hookimpl
from pagedkv.core.sched.scheduler import FCFSScheduler

@hookimpl
def pagedkv_register_schedulers(register):
    register("{scheduler}", FCFSScheduler, "fcfs under another name")

@hookimpl
def pagedkv_report_stats():
    return {{"{scheduler}_loaded": 1}}
'''

BROKEN = "import pagedkv_no_such_module_anywhere  # fails on import\n"


@pytest.fixture
def site(tmp_path, monkeypatch):
    """``install(dist, {entry point: source})`` puts a small distribution on sys.path; returns scheduler names."""
    monkeypatch.delenv("PAGEDKV_PLUGINS", raising=False)
    monkeypatch.delenv("PAGEDKV_DISABLE_PLUGINS", raising=False)
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    modules: list[str] = []

    def install(dist: str, plugins: dict[str, str], version: str = "1.2.3") -> dict[str, str]:
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines, schedulers = ["[pagedkv]"], {}
        for ep_name, source in plugins.items():
            module = f"fake_pagedkv_plugin_{next(_unique)}"
            schedulers[ep_name] = f"sched_{module}"
            (root / f"{module}.py").write_text(source.format(scheduler=schedulers[ep_name]))
            lines.append(f"{ep_name} = {module}")
            modules.append(module)
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        return schedulers

    yield install
    for module in modules:
        sys.modules.pop(module, None)


def schedulers(pm):
    return build_registry(pm, "scheduler", "pagedkv_register_schedulers").names()


def rows_by_name(pm=None):
    return {row["name"]: row for row in list_plugins(pm)}


def test_a_third_party_plugin_loads_through_its_entry_point_alone(site):
    names = site("pagedkv-fake", {"fake": GOOD})
    pm = make_plugin_manager()
    assert names["fake"] in schedulers(pm) and "fcfs" in schedulers(pm)
    row = rows_by_name(pm)["fake"]
    assert row["distribution"] == "pagedkv-fake" and row["version"] == "1.2.3"
    assert row["builtin"] is False and row["status"] == "loaded" and row["error"] is None
    assert row["hooks"] == ["pagedkv_register_schedulers", "pagedkv_report_stats"]
    builtin = rows_by_name(pm)["prefix_cache"]
    assert builtin["distribution"] == "pagedkv" and builtin["builtin"] is True
    assert builtin["hooks"] == ["pagedkv_configure"]


def test_pagedkv_plugins_loads_only_the_named_third_party_plugins(site, monkeypatch):
    names = site("pagedkv-fake", {"alpha": GOOD, "beta": GOOD})
    monkeypatch.setenv("PAGEDKV_PLUGINS", " alpha , ")
    pm = make_plugin_manager()
    assert names["alpha"] in schedulers(pm) and names["beta"] not in schedulers(pm)
    assert "fcfs" in schedulers(pm)  # built-ins always load
    rows = rows_by_name(pm)
    assert (rows["alpha"]["status"], rows["beta"]["status"]) == ("loaded", "not selected")
    assert rows["beta"]["hooks"] == [] and rows["torch"]["status"] == "loaded"


def test_an_empty_pagedkv_plugins_loads_no_third_party_plugin(site, monkeypatch):
    names = site("pagedkv-fake", {"alpha": GOOD})
    monkeypatch.setenv("PAGEDKV_PLUGINS", "")
    pm = make_plugin_manager()
    assert schedulers(pm) == ["fcfs", "priority"] and names["alpha"] not in schedulers(pm)
    assert build_registry(pm, "backend", "pagedkv_register_backends").names() == ["cpu", "cupy", "torch", "triton"]
    assert {r["name"]: r["status"] for r in list_plugins(pm) if not r["builtin"]} == {"alpha": "not selected"}


def test_pagedkv_disable_plugins_blocks_third_party_and_built_in_plugins(site, monkeypatch):
    names = site("pagedkv-fake", {"alpha": GOOD, "beta": GOOD})
    monkeypatch.setenv("PAGEDKV_DISABLE_PLUGINS", "beta,cupy")
    pm = make_plugin_manager()
    assert names["alpha"] in schedulers(pm) and names["beta"] not in schedulers(pm)
    assert build_registry(pm, "backend", "pagedkv_register_backends").names() == ["cpu", "torch", "triton"]
    assert pm.is_blocked("beta") and pm.is_blocked("cupy")
    rows = rows_by_name(pm)
    assert rows["beta"]["status"] == rows["cupy"]["status"] == "disabled"


def test_disable_wins_over_a_request(site, monkeypatch, caplog):
    names = site("pagedkv-fake", {"alpha": GOOD})
    monkeypatch.setenv("PAGEDKV_PLUGINS", "alpha")
    monkeypatch.setenv("PAGEDKV_DISABLE_PLUGINS", "alpha")
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        pm = make_plugin_manager()
    assert names["alpha"] not in schedulers(pm)
    assert "'alpha' is both requested" in caplog.text


def test_a_broken_plugin_is_reported_and_skipped(site, caplog):
    names = site("pagedkv-fake", {"good": GOOD, "broken": BROKEN})
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        pm = make_plugin_manager()
    assert names["good"] in schedulers(pm) and not pm.has_plugin("broken")
    [record] = [r for r in caplog.records if "broken" in r.getMessage()]
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    assert "'broken'" in message and "fake_pagedkv_plugin_" in message and "pagedkv-fake" in message
    assert "ModuleNotFoundError" in message and "pagedkv_no_such_module_anywhere" in message
    row = rows_by_name(pm)["broken"]
    assert row["status"] == "failed" and "pagedkv_no_such_module_anywhere" in row["error"]


def test_the_engine_starts_without_a_broken_plugin(site, caplog):
    from pagedkv import SamplingParams
    from pagedkv.testing import tiny_engine, tiny_llama

    site("pagedkv-fake", {"broken": BROKEN})
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        engine = tiny_engine(model=tiny_llama(num_hidden_layers=1))
    assert "'broken'" in caplog.text
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.generated_tokens == 2


def test_a_broken_plugin_that_was_asked_for_is_an_error(site, monkeypatch):
    site("pagedkv-fake", {"good": GOOD, "broken": BROKEN})
    monkeypatch.setenv("PAGEDKV_PLUGINS", "good,broken")
    with pytest.raises(ConfigError, match=r"'broken'.*PAGEDKV_PLUGINS.*failed to import.*ModuleNotFoundError"):
        make_plugin_manager()


def test_asking_for_a_plugin_that_is_not_installed_is_an_error(site, monkeypatch):
    site("pagedkv-fake", {"good": GOOD})
    monkeypatch.setenv("PAGEDKV_PLUGINS", "good,nosuch")
    with pytest.raises(ConfigError, match=r"'nosuch'.*no such plugin is installed.*good"):
        make_plugin_manager()


def test_a_name_taken_twice_keeps_the_first_and_warns(site, caplog):
    site("pagedkv-one", {"same": GOOD})
    site("pagedkv-two", {"same": GOOD})
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        pm = make_plugin_manager()
    assert len([n for n in schedulers(pm) if n.startswith("sched_")]) == 1
    assert "'same' is taken by" in caplog.text


def test_directly_registered_plugins_are_listed_too(site):
    class Observer:
        def pagedkv_report_stats(self):
            return {}

    from pagedkv.core.hookspecs import hookimpl

    Observer.pagedkv_report_stats = hookimpl(Observer.pagedkv_report_stats)
    pm = make_plugin_manager([Observer()])
    [row] = [r for r in list_plugins(pm) if r["status"] == "registered"]
    assert row["module"].endswith("Observer") and row["hooks"] == ["pagedkv_report_stats"]


def test_engine_plugins_cli(site, capsys, monkeypatch):
    site("pagedkv-fake", {"fake": GOOD, "broken": BROKEN})
    monkeypatch.setenv("PAGEDKV_DISABLE_PLUGINS", "triton")
    assert cli.main(["plugins", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert {"torch", "cupy", "schedulers", "prefix_cache", "copy_on_write", "cpu_swap", "fake"} <= set(rows)
    assert rows["fake"]["distribution"] == "pagedkv-fake" and rows["fake"]["status"] == "loaded"
    assert rows["triton"]["status"] == "disabled" and rows["broken"]["status"] == "failed"
    assert cli.main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "pagedkv-fake 1.2.3" in text and "third-party" in text and "pagedkv_register_schedulers" in text
    assert "error: ModuleNotFoundError" in text
    monkeypatch.setenv("PAGEDKV_PLUGINS", "broken")
    assert cli.main(["plugins"]) == 2
    assert "failed to import" in capsys.readouterr().err
