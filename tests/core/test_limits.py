"""One number cannot make the engine, the simulator or the monitor grow without bound; each cap can be raised."""

from __future__ import annotations

import json

import pytest

from pagedkv.core.config import EngineConfig, parse_bytes
from pagedkv.core.engine import Engine
from pagedkv.core.errors import ConfigError, RequestRejected
from pagedkv.core.limits import cap, check_host_memory
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.monitor.trace import TraceError, read_trace
from pagedkv.sim.simulated_runner import SimulatedRunner
from pagedkv.sim.workload import WorkloadError, builtin_workload, load_jsonl


def test_a_billion_samples_is_refused_at_add_request_and_the_engine_goes_on(tiny_llama):
    engine = Engine(EngineConfig(device="cpu", num_blocks=16, block_size=4), model=tiny_llama)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    params.n = 10**9  # whatever SamplingParams itself accepts, the engine has its own cap
    with pytest.raises(RequestRejected, match="PAGEDKV_MAX_SAMPLES"):
        engine.add_request([1, 2, 3], params)
    assert not engine.has_unfinished() and engine.stats.requests == 0
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == engine.num_blocks


def test_a_cap_is_raised_by_its_environment_variable(monkeypatch):
    assert cap("requests") == 2_000_000
    monkeypatch.setenv("PAGEDKV_MAX_REQUESTS", "3")
    assert len(builtin_workload("alpaca", 3).requests) == 3
    with pytest.raises(WorkloadError, match="PAGEDKV_MAX_REQUESTS=4"):
        builtin_workload("alpaca", 4)
    monkeypatch.setenv("PAGEDKV_MAX_REQUESTS", "lots")
    with pytest.raises(ConfigError, match="PAGEDKV_MAX_REQUESTS"):
        cap("requests")


def test_a_workload_file_with_too_many_requests_names_the_cap(tmp_path, monkeypatch):
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps({"prompt_len": 4, "output_len": 4}) + "\n" for _ in range(5)))
    monkeypatch.setenv("PAGEDKV_MAX_REQUESTS", "4")
    with pytest.raises(WorkloadError, match="PAGEDKV_MAX_REQUESTS"):
        load_jsonl(path)


def test_a_simulated_pool_above_the_block_cap_is_refused(monkeypatch):
    from pagedkv.sim.model_budget import load_model_config

    shape = load_model_config(None)
    monkeypatch.setenv("PAGEDKV_MAX_BLOCKS", "1000")
    assert Engine(EngineConfig(device="cpu", num_blocks=1000), runner=SimulatedRunner(shape)).num_blocks == 1000
    with pytest.raises(ConfigError, match="PAGEDKV_MAX_BLOCKS"):
        Engine(EngineConfig(device="cpu", num_blocks=1001), runner=SimulatedRunner(shape))


def test_a_trace_hello_with_a_billion_blocks_or_an_oversized_file_is_a_trace_error(tmp_path, monkeypatch):
    path = tmp_path / "t.ndjson"
    path.write_text(json.dumps({"v": 2, "seq": 0, "type": "hello", "t": 0, "num_blocks": 10**9, "block_size": 4}))
    with pytest.raises(TraceError, match="line 1.*PAGEDKV_MAX_BLOCKS"):
        read_trace(path)
    monkeypatch.setenv("PAGEDKV_MAX_TRACE_BYTES", "10")
    with pytest.raises(TraceError, match="PAGEDKV_MAX_TRACE_BYTES"):
        read_trace(path)


@pytest.mark.parametrize("text", ["infGiB", "-infMiB", "1e400GiB"])
def test_an_infinite_size_is_a_config_error(text):
    with pytest.raises(ConfigError):
        parse_bytes(text)


def test_host_memory_beyond_what_is_available_is_refused():
    with pytest.raises(ConfigError, match="available"):
        check_host_memory(1 << 60, "the test")
    check_host_memory(1 << 20, "a small buffer")


def test_a_kv_cache_larger_than_ram_is_refused_after_the_model_is_known(tiny_llama):
    with pytest.raises(ConfigError, match="host memory"):
        Engine(EngineConfig(device="cpu", kv_cache_memory="1000000TiB"), model=tiny_llama)
