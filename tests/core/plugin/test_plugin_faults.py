"""Issue 16, item 2: no plugin fault can break the engine.

Pool hooks (a block released / evicted) and start-up hooks (registrars, ``pagedkv_configure``,
``pagedkv_swap_space``, ``pagedkv_engine_started``) are contained as ``core/plugin/plugin_guard.py`` says:
the faulty plugin is disabled with a log line naming it and ``PAGEDKV_DISABLE_PLUGINS``, or, if it was
asked for, the engine refuses to start with one ConfigError line.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from test_plugin_controls import site  # noqa: F401 - the fixture that installs tiny plugin distributions

from conftest import drain
from pagedkv import EngineConfig, SamplingParams
from pagedkv.cli import main as cli
from pagedkv.core.errors import ConfigError
from pagedkv.core.hookspecs import hookimpl
from pagedkv.sim.sim_engine import SimEngine
from pagedkv.sim.simulated_runner import SimulatedRunner

SIM_MODEL = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            hidden_size=64, max_position_embeddings=4096, vocab_size=1000)
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def sim_engine(*plugins, **config):
    config = {"device": "cpu", "num_blocks": 16, "block_size": 4, **config}
    return SimEngine(EngineConfig(**config), runner=SimulatedRunner(SIM_MODEL), decode_lane=False, plugins=plugins)


def run_all(engine, prompts):
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    results, _ = drain(engine, limit=5000)
    return [results[i] for i in ids]


def assert_clean(engine):
    engine.check_invariants()
    assert engine.pool.num_available == engine.num_blocks


# --- pool hooks ---------------------------------------------------------------------------------------


class KeepsThenRaises:
    """Keeps every released block (as a cache would); raises on the n-th release, or on every eviction."""

    def __init__(self, raise_on_release: int | None = None, raise_on_evict: bool = False) -> None:
        self.releases = 0
        self.raise_on_release = raise_on_release
        self.raise_on_evict = raise_on_evict

    @hookimpl
    def pagedkv_on_block_released(self, block_id):
        self.releases += 1
        if self.releases == self.raise_on_release:
            raise RuntimeError("release bug")
        return True

    @hookimpl
    def pagedkv_on_block_evicted(self, block_id):
        if self.raise_on_evict:
            raise RuntimeError("evict bug")


def test_a_transient_raise_on_block_release_leaks_nothing_and_loses_no_output(caplog):
    broken = KeepsThenRaises(raise_on_release=1)
    engine = sim_engine(broken)
    with caplog.at_level(logging.ERROR, logger="pagedkv"):
        outs = run_all(engine, [[1] * 10, [2] * 7])
    assert [len(o.token_ids) for o in outs] == [12, 12]  # the request whose release raised kept its output
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert not engine.pm.is_registered(broken)
    assert "raised in pagedkv_on_block_released and is disabled" in caplog.text
    assert "PAGEDKV_DISABLE_PLUGINS" in caplog.text
    assert engine.pool.num_cached == 0  # the block whose release raised was freed, not kept
    assert_clean(engine)


def test_a_persistent_raise_on_eviction_cannot_wedge_the_pool(caplog):
    broken = KeepsThenRaises(raise_on_evict=True)
    engine = sim_engine(broken)
    with caplog.at_level(logging.ERROR, logger="pagedkv"):
        first = run_all(engine, [[1] * 20, [2] * 20])  # every block ends cached: 0 plain free blocks
        assert engine.pool.num_free == 0 and engine.pool.num_cached == 16
        second = run_all(engine, [[3] * 20, [4] * 20])  # needs evictions, which raise
    assert all(len(o.token_ids) == 12 for o in first + second)
    assert not engine.pm.is_registered(broken)
    assert "raised in pagedkv_on_block_evicted" in caplog.text
    assert_clean(engine)


# --- start-up hooks ----------------------------------------------------------------------------------

REGISTRAR_RAISES = '''
from pagedkv.core.hookspecs import hookimpl
from pagedkv.core.sched.scheduler import FCFSScheduler

@hookimpl
def pagedkv_register_schedulers(register):
    register("{scheduler}", FCFSScheduler, "registered before the fault: must not stay")
    raise RuntimeError("registrar bug")
'''

CONFIGURE_RAISES = '''
from pagedkv.core.hookspecs import hookimpl

@hookimpl
def pagedkv_configure(config, pm):
    raise RuntimeError("configure bug")
'''

STARTED_RAISES = '''
from pagedkv.core.hookspecs import hookimpl

@hookimpl
def pagedkv_engine_started(engine):
    raise RuntimeError("started bug")
'''

INSTANCE_STARTED_RAISES = '''
from pagedkv.core.hookspecs import hookimpl

class State:
    @hookimpl
    def pagedkv_engine_started(self, engine):
        raise RuntimeError("instance bug")

@hookimpl
def pagedkv_configure(config, pm):
    if config.plugin_options.get("flaky", {{}}).get("on"):
        pm.register(State(), name="flaky.instance")
'''


@pytest.mark.parametrize("source,hook", [(REGISTRAR_RAISES, "pagedkv_register_schedulers"),
                                         (CONFIGURE_RAISES, "pagedkv_configure"),
                                         (STARTED_RAISES, "pagedkv_engine_started")],
                         ids=["registrar", "configure", "engine_started"])
def test_a_plugin_raising_at_start_up_is_left_out_and_named(site, caplog, source, hook):  # noqa: F811
    names = site("pagedkv-fake", {"flaky": source})
    with caplog.at_level(logging.ERROR, logger="pagedkv"):
        engine = sim_engine()
    assert not engine.pm.has_plugin("flaky")
    assert f"'flaky' raised in {hook} and is disabled" in caplog.text
    assert "PAGEDKV_DISABLE_PLUGINS=flaky" in caplog.text
    if hook == "pagedkv_register_schedulers":
        with pytest.raises(ConfigError, match="unknown scheduler"):
            sim_engine(scheduler=names["flaky"])  # its half-made registration did not stay
    assert [len(o.token_ids) for o in run_all(engine, [[1] * 5])] == [12]
    assert_clean(engine)


@pytest.mark.parametrize("source,hook", [(REGISTRAR_RAISES, "pagedkv_register_schedulers"),
                                         (CONFIGURE_RAISES, "pagedkv_configure"),
                                         (STARTED_RAISES, "pagedkv_engine_started")],
                         ids=["registrar", "configure", "engine_started"])
def test_a_plugin_asked_for_by_name_that_raises_at_start_up_is_one_clear_error(site, monkeypatch, source, hook):  # noqa: F811
    site("pagedkv-fake", {"flaky": source})
    monkeypatch.setenv("PAGEDKV_PLUGINS", "flaky")
    with pytest.raises(ConfigError, match=rf"^pagedkv plugin 'flaky' failed in {hook}: RuntimeError: .* bug") as info:
        sim_engine()
    assert "\n" not in str(info.value)


def test_a_plugin_switched_on_by_config_that_raises_at_start_up_is_one_clear_error(site, caplog):  # noqa: F811
    site("pagedkv-fake", {"flaky": INSTANCE_STARTED_RAISES})
    engine = sim_engine()  # not switched on: nothing happens
    assert not engine.pm.has_plugin("flaky.instance")
    with pytest.raises(ConfigError, match=r"'flaky.instance' failed in pagedkv_engine_started.*"
                                          r"PAGEDKV_DISABLE_PLUGINS=flaky\)$"):
        sim_engine(plugin_options={"flaky": {"on": True}})


def test_a_plugin_passed_to_the_engine_that_raises_at_start_up_is_one_clear_error():
    class Broken:
        @hookimpl
        def pagedkv_engine_started(self, engine):
            raise ValueError("broken on purpose")

    with pytest.raises(ConfigError, match="failed in pagedkv_engine_started: ValueError: broken on purpose"):
        sim_engine(Broken())


def test_a_raising_swap_space_plugin_is_contained_like_any_start_up_hook(caplog):
    class BrokenSwap:
        @hookimpl
        def pagedkv_swap_space(self, config, spec):
            raise RuntimeError("no swap today")

    with pytest.raises(ConfigError, match="failed in pagedkv_swap_space"):
        sim_engine(BrokenSwap())  # passed in by hand: asked for


def test_engine_simulate_with_a_broken_plugin(site, monkeypatch, capsys, caplog):  # noqa: F811
    site("pagedkv-fake", {"flaky": STARTED_RAISES})
    argv = ["simulate", "--num-requests", "4", "--num-blocks", "64", "--no-static", "--json"]
    with caplog.at_level(logging.ERROR, logger="pagedkv"):
        assert cli.main(argv) == 0  # runs without it
    assert "'flaky' raised in pagedkv_engine_started" in caplog.text
    capsys.readouterr()
    monkeypatch.setenv("PAGEDKV_PLUGINS", "flaky")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("engine: error: pagedkv plugin 'flaky' failed in pagedkv_engine_started")
    assert err.count("\n") == 1 and "Traceback" not in err



def test_an_instance_registered_without_a_name_is_named_by_its_type_and_its_entry_point(site):  # noqa: F811
    site("pagedkv-fake", {"flaky": INSTANCE_STARTED_RAISES.replace(', name="flaky.instance"', "")})
    with pytest.raises(ConfigError, match=r"^pagedkv plugin 'State' failed in pagedkv_engine_started: "
                                          r"RuntimeError: instance bug .*PAGEDKV_DISABLE_PLUGINS=flaky\)$"):
        sim_engine(plugin_options={"flaky": {"on": True}})
