"""pagedkv.testing, the helpers for plugin authors: the tiny model and temporary registration."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedkv import SamplingParams
from pagedkv.core.hookspecs import hookimpl
from pagedkv.testing import TINY_VOCAB, registered, tiny_engine, tiny_llama


class StatsProbe:
    def __init__(self):
        self.engine = None

    @hookimpl
    def pagedkv_engine_started(self, engine):
        self.engine = engine

    @hookimpl
    def pagedkv_report_stats(self):
        return {"probe": 1}


def test_tiny_llama_is_deterministic_and_takes_overrides():
    a, b = tiny_llama(seed=3), tiny_llama(seed=3)
    assert a.config.vocab_size == TINY_VOCAB and a.config.num_hidden_layers == 2 and not a.training
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert tiny_llama(num_hidden_layers=1, hidden_size=32).config.hidden_size == 32


def test_registered_is_undone_after_the_block_even_on_error():
    engine = tiny_engine(model=tiny_llama(num_hidden_layers=1))
    probe = StatsProbe()
    with registered(engine, probe, name="probe") as plugin:
        assert plugin is probe and probe.engine is engine  # it was told the engine had started
        assert engine.pm.get_plugin("probe") is probe
        assert {"probe": 1} in engine.pm.hook.pagedkv_report_stats()
    assert not engine.pm.is_registered(probe)
    with pytest.raises(RuntimeError), registered(engine, StatsProbe()) as again:
        raise RuntimeError("boom")
    assert not engine.pm.is_registered(again)
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.generated_tokens == 2


def test_registered_refuses_plugins_whose_hooks_only_run_at_build_time():
    import pagedkv.plugins.prefix_cache

    engine = tiny_engine(model=tiny_llama(num_hidden_layers=1))
    with pytest.raises(ValueError, match="pagedkv_configure"):
        with registered(engine, pagedkv.plugins.prefix_cache):
            pass


def test_importing_it_pulls_in_neither_pytest_nor_transformers():
    code = "import sys, pagedkv.testing; print([m for m in ('pytest', 'transformers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
