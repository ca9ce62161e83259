"""Tensor parallelism over 2 gloo processes on CPU: same greedy tokens as one process and as transformers.

Starting a rank costs seconds on a shared machine, so each model gets one 2-rank engine for the whole
module, configured with prefix caching, copy-on-write and CPU swap all on and a cache small enough that
requests are preempted and swapped; a 1-process engine with the same configuration and transformers'
``generate`` are the references. The last tests stop (hang) or kill a worker and check that no rank outlives
its engine.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import VOCAB, hf_greedy, random_prompts
from pagedkv.core.config import EngineConfig
from pagedkv.core.dist.distributed import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, TensorParallelError
from pagedkv.core.engine import Engine
from pagedkv.core.errors import ConfigError
from pagedkv.core.sample.sampling_params import SamplingParams

MAX_TOKENS = 8
SETTINGS = dict(
    device="cpu", block_size=4, num_blocks=16, max_num_seqs=4, enable_prefix_caching=True,
    enable_copy_on_write=True, swap_space=1 << 20,
)


def _tiny_qwen2_two_kv_heads():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    return Qwen2ForCausalLM(cfg).eval()


def _tiny_llama():
    from conftest import _tiny_llama as build

    return build(seed=2)


BUILDERS = {"llama": _tiny_llama, "qwen2": _tiny_qwen2_two_kv_heads}


def _workload() -> list[tuple[list[int], int]]:
    """(prompt, n): distinct prompts, one with n=2 (copy-on-write), and two sharing a 12-token prefix, the second
    admitted after the first's blocks are cached (a prefix-cache hit)."""
    shared = random_prompts([12], seed=4)[0]
    distinct = [(p, 1) for p in random_prompts([5, 9, 13, 7, 11, 6], seed=3)]
    return [(shared + [7, 8, 9], 1), *distinct[:3], (shared + [10, 11], 1), *distinct[3:],
            (random_prompts([10], seed=5)[0], 2)]


def _generate(engine: Engine) -> list[list[list[int]]]:
    params = {n: SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=n) for n in (1, 2)}
    ids = [engine.add_request(p, params[n]) for p, n in _workload()]
    results = {}
    while engine.has_unfinished():
        for out in engine.step(stream=False):
            results[out.request_id] = [list(o.token_ids) for o in out.outputs]
        engine.check_invariants()
    return [results[i] for i in ids]


def _rank_children() -> list[int]:
    """Pids of this process's children that are tensor-parallel ranks (read from /proc)."""
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:  # a spawned rank (not multiprocessing's resource tracker)
                pids.append(int(pid))
    return pids


HANG_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def runs():
    """Per model: the 2-rank engine, its outputs and stats, and the 1-process reference. One process holds one
    tensor-parallel engine at a time: the llama one is closed (its ranks' fate recorded), the qwen2 one (with a
    short collective timeout) is kept open for the hang test."""
    found = {}
    for name, build in BUILDERS.items():
        single = _generate(Engine(EngineConfig(**SETTINGS), model=build()))
        os.environ[TIMEOUT_ENV] = str(HANG_TIMEOUT_S if name == "qwen2" else DEFAULT_TIMEOUT_S)
        try:
            engine = Engine(EngineConfig(**SETTINGS, tensor_parallel_size=2), model=build())
        finally:
            del os.environ[TIMEOUT_ENV]
        found[name] = (engine, _generate(engine), single, engine.plugin_stats())
        if name == "llama":
            workers = list(engine.runner.group.processes)
            alive_before = [w.is_alive() for w in workers]
            engine.close()
            found["llama_close"] = (alive_before, [w.exitcode for w in workers], _rank_children())
    yield found
    found["qwen2"][0].close()


@pytest.mark.parametrize("name", list(BUILDERS))
def test_two_ranks_match_one_process_and_transformers(runs, name):
    engine, sharded, single, stats = runs[name]
    assert sharded == single
    model = BUILDERS[name]()
    expected = [[hf_greedy(model, prompt, MAX_TOKENS)] * n for prompt, n in _workload()]
    assert sharded == expected
    # the run really exercised the shared-block paths on every rank
    assert stats["swap_outs"] > 0 and stats["swap_ins"] > 0
    assert stats["prefix_hit_tokens"] > 0
    assert engine.stats.blocks_shared_by_fork > 0


def test_each_rank_holds_half_the_kv_heads_and_the_capacity_line_says_so(runs):
    engine = runs["llama"][0]
    assert engine.spec.num_kv_heads == 1
    assert all(k.shape[2] == 1 for k, _ in engine.runner.kv_caches)
    assert engine.runner.inner.model.model.layers[0].self_attn.q_proj.weight.shape[0] == 2 * 16
    line = engine.capacity_line()
    assert "tensor parallel over 2 ranks, 1 KV heads each" in line and "per rank" in line and "in total" in line


def test_kv_heads_not_divisible_is_a_config_error_before_any_rank_starts(tiny_models):
    before = _rank_children()
    with pytest.raises(ConfigError, match="does not divide the model's 1 KV heads"):
        Engine(EngineConfig(device="cpu", num_blocks=8, tensor_parallel_size=2), model=tiny_models["qwen2"])
    assert _rank_children() == before
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(device="cpu", tensor_parallel_size=0)


def _fail_a_worker(engine: Engine, sig: int) -> tuple[TensorParallelError, float, object]:
    worker = engine.runner.group.processes[0]
    os.kill(worker.pid, sig)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    started = time.monotonic()
    with pytest.raises(TensorParallelError) as caught:
        while engine.has_unfinished():
            engine.step()
    return caught.value, time.monotonic() - started, worker


def test_a_hung_worker_ends_the_step_with_a_clear_error_after_the_timeout(runs):
    error, seconds, worker = _fail_a_worker(runs["qwen2"][0], signal.SIGSTOP)
    assert "Timed out" in str(error) and f"{TIMEOUT_ENV}={HANG_TIMEOUT_S} s" in str(error)
    assert HANG_TIMEOUT_S - 1 < seconds < HANG_TIMEOUT_S + 20
    assert not worker.is_alive() and not torch.distributed.is_initialized()


def test_a_killed_worker_ends_the_run_with_a_clear_error():
    engine = Engine(EngineConfig(device="cpu", num_blocks=16, tensor_parallel_size=2), model=_tiny_llama())
    error, seconds, worker = _fail_a_worker(engine, signal.SIGKILL)
    assert re.search(r"rank 1 \(pid \d+\) exited with code -9", str(error))
    assert seconds < 30
    assert not torch.distributed.is_initialized()
    with pytest.raises(TensorParallelError, match="closed"):
        engine.step()


def test_no_rank_outlives_its_engine(runs):
    alive_before, alive_after, children_after = runs["llama_close"]
    assert alive_before == [True] and alive_after == [0] and children_after == []  # exit code 0: a clean stop
    runs["qwen2"][0].close()  # (already stopped by the fault test; closing twice is harmless)
    assert _rank_children() == []


def test_one_tensor_parallel_engine_per_process_at_a_time(runs):
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="already"):
            Engine(EngineConfig(**SETTINGS, tensor_parallel_size=2), model=_tiny_llama())
    finally:
        torch.distributed.destroy_process_group()
