"""`engine simulate`: the same allocator/scheduler/plugins as a real run, workloads, budgets, bad input."""

from __future__ import annotations

import json
import math

import pytest

from conftest import random_prompts
from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.hookspecs import hookimpl
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.sim.model_budget import SimulationError, estimate_params, gpu_kv_budget, load_model_config
from pagedkv.sim.simulate import SimSetup, parse_sweep, run_once, simulate
from pagedkv.sim.step_time_model import StepTimeModel, calibrate_from_trace
from pagedkv.sim.workload import WorkloadError, builtin_workload, load_jsonl, load_trace, load_workload

KINDS = ("block_alloc", "block_free", "block_share", "block_keep", "block_evict", "request_preempt")


class Recorder:
    """A throwaway plugin: the block and preemption events of every step."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, dict]]] = []

    @hookimpl
    def pagedkv_on_step_events(self, events):
        self.steps.append([(e.kind, dict(e.data)) for e in events if e.kind in KINDS])


def _real_run(model, config, batches, recorder):
    """``batches``: {step index: [(request id, prompt ids, output len)]}; requests join before that step."""
    engine = Engine(config, model=model, plugins=(recorder,))
    step = 0
    while step <= max(batches) or engine.has_unfinished():
        for rid, prompt, out_len in batches.get(step, []):
            engine.add_request(prompt, SamplingParams(max_tokens=out_len, ignore_eos=True), request_id=rid)
        if engine.has_unfinished():
            engine.step(stream=False)
        step += 1
    if config.trace:
        from pagedkv.plugins.telemetry import close

        close(engine)
    return engine


def test_trace_replayed_by_the_simulator_gives_the_same_blocks_and_preemptions(tiny_llama, tmp_path):
    lengths = [5, 9, 3, 14, 7, 11]
    outs = [12, 6, 20, 9, 15, 4]
    prompts = random_prompts(lengths, seed=3)
    batches = {0: [(f"r{i}", prompts[i], outs[i]) for i in range(4)],
               3: [(f"r{i}", prompts[i], outs[i]) for i in range(4, 6)]}
    trace = tmp_path / "real.ndjson"
    kw = dict(block_size=4, num_blocks=14, max_num_seqs=4, max_num_batched_tokens=16, device="cpu")
    real = Recorder()
    engine = _real_run(tiny_llama, EngineConfig(trace=str(trace), **kw), batches, real)
    assert engine.stats.preemptions > 0, "the budget must force preemptions for this test to mean something"

    wl = load_trace(trace)
    assert [(r.request_id, r.prompt_len, r.output_len, r.arrival_step) for r in wl.requests] == [
        (f"r{i}", lengths[i], outs[i], 0 if i < 4 else 3) for i in range(6)
    ]
    sim = Recorder()
    setup = SimSetup(model_config=tiny_llama.config, block_size=4, num_blocks=14, max_num_seqs=4,
                     max_num_batched_tokens=16, dtype="float32")
    result = run_once(wl, setup, plugins=(sim,))
    assert sim.steps == real.steps
    assert result["preemptions"] == engine.stats.preemptions
    assert result["tokens_recomputed"] == engine.stats.tokens_recomputed
    assert result["peak_kv_blocks_used"] == engine.stats.peak_blocks_used


def test_jsonl_with_token_ids_replays_prefix_caching_exactly(tiny_llama, tmp_path):
    shared = random_prompts([12], seed=5)[0]
    tails = random_prompts([3, 6, 2, 9, 5], seed=6)
    outs = [7, 3, 11, 5, 8]
    prompts = [shared + t for t in tails]
    kw = dict(block_size=4, num_blocks=20, max_num_seqs=3, max_num_batched_tokens=24, device="cpu",
              enable_prefix_caching=True)
    real = Recorder()
    engine = _real_run(tiny_llama, EngineConfig(**kw), {0: [(f"q{i}", p, o) for i, (p, o) in
                                                          enumerate(zip(prompts, outs))]}, real)
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"q{i}", "prompt_token_ids": p, "output_len": o})
                              for i, (p, o) in enumerate(zip(prompts, outs))) + "\n")
    sim = Recorder()
    setup = SimSetup(model_config=tiny_llama.config, block_size=4, num_blocks=20, max_num_seqs=3,
                     max_num_batched_tokens=24, dtype="float32", enable_prefix_caching=True)
    result = run_once(load_jsonl(path), setup, plugins=(sim,))
    assert sim.steps == real.steps
    assert any(kind == "block_share" for step in real.steps for kind, _ in step)
    hook_stats = {k: v for a in engine.pm.hook.pagedkv_report_stats() for k, v in a.items()}
    assert result["prefix_hit_rate"] == hook_stats["prefix_hit_rate"] > 0


def test_builtin_workloads_are_seeded_and_have_the_published_means():
    a = builtin_workload("sharegpt", 20000, seed=1)
    b = builtin_workload("sharegpt", 20000, seed=1)
    assert [(r.prompt_len, r.output_len) for r in a.requests] == [(r.prompt_len, r.output_len) for r in b.requests]
    assert a.mean_prompt_len == pytest.approx(161.31, rel=0.06)
    assert a.mean_output_len == pytest.approx(337.99, rel=0.06)
    c = builtin_workload("alpaca", 20000, seed=2)
    assert c.mean_prompt_len == pytest.approx(19.31, rel=0.06)
    assert c.mean_output_len == pytest.approx(58.45, rel=0.06)
    d = builtin_workload("shared-prefix", 10, seed=0, request_rate=5.0)
    assert all(r.shared_prefix_len == 512 and r.prompt_len > 512 for r in d.requests)
    assert all(x.arrival < y.arrival for x, y in zip(d.requests, d.requests[1:]))


def test_paged_beats_static_and_prefix_caching_hits():
    wl = builtin_workload("shared-prefix", 60, seed=0)
    report = simulate(wl, SimSetup(num_blocks=600, enable_prefix_caching=True, max_model_len=2048),
                      sweeps=[parse_sweep("block_size=8,32"), parse_sweep("kv_blocks=300,600")])
    paged, static = report["paged"], report["static"]
    assert paged["finished"] == static["finished"] == 60
    assert paged["peak_running"] > static["peak_running"]
    assert paged["kv_waste_pct_at_peak"] < static["kv_waste_pct_at_peak"]
    assert paged["prefix_hit_rate"] > 0.5
    assert paged["ttft_s"]["p50"] > 0 and paged["throughput_tokens_per_s"] > 0
    assert [r["block_size"] for r in report["sweeps"][0]["rows"]] == [8, 32]
    assert [r["num_blocks"] for r in report["sweeps"][1]["rows"]] == [300, 600]
    # block-size sweep keeps the bytes: twice the block size, half the blocks
    assert report["sweeps"][0]["rows"][0]["num_blocks"] == 4 * report["sweeps"][0]["rows"][1]["num_blocks"]


def test_arrivals_follow_the_step_time_clock():
    wl = builtin_workload("alpaca", 40, seed=0, request_rate=2.0)  # ~20 s of arrivals
    slow = StepTimeModel(0.01, 0.0, 0.0)
    result = run_once(wl, SimSetup(num_blocks=2000), slow)
    assert result["sim_time_s"] >= wl.requests[-1].arrival - wl.requests[0].arrival
    assert result["peak_running"] < 40  # they do not all arrive at once


def test_swap_traffic_is_reported():
    wl = builtin_workload("sharegpt", 40, seed=0)
    result = run_once(wl, SimSetup(num_blocks=300, swap_space="64MiB", max_model_len=4096), series=False)
    assert result["preemptions"] > 0 and result["swap_outs"] > 0 and result["swap_bytes_moved"] > 0


def test_gpu_budget_subtracts_the_weights():
    cfg = load_model_config(None)
    assert estimate_params(cfg) == pytest.approx(134.5e6, rel=0.01)  # SmolLM2-135M
    b = gpu_kv_budget(cfg, 80 * 2**30, 0.9, "bfloat16")
    assert b["kv_bytes"] == int(80 * 2**30 * 0.9) - b["params"] * 2
    with pytest.raises(SimulationError, match="--gpu-memory"):
        gpu_kv_budget(cfg, 2**30, 0.9, "bfloat16", num_params=8e9)


def test_model_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 131072,
    }))
    cfg = load_model_config(tmp_path)
    assert estimate_params(cfg) == pytest.approx(8.03e9, rel=0.01)  # Llama-3-8B
    (tmp_path / "bad.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(SimulationError, match="missing num_attention_heads"):
        load_model_config(tmp_path / "bad.json")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"prompt_len": 5, "output_len": 3}\n{"prompt_len": 5, "output_len": 3\n', "line 2: not valid JSON"),
        ('{"prompt_len": 5}\n', "line 1: 'output_len' is missing"),
        ('\n{"prompt_len": 0, "output_len": 3}\n', "line 2: 'prompt_len' must be an integer >= 1"),
        ('{"prompt_len": 5, "output_len": 3, "arrival": -1}\n', "line 1: 'arrival' must be"),
        ('{"prompt_len": 5, "output_len": 3, "arival": 1}\n', "line 1: unknown field"),
        ('[1, 2]\n', "line 1: expected a JSON object"),
        ('{"prompt_token_ids": [1, "a"], "output_len": 3}\n', "line 1: 'prompt_token_ids'"),
        ('{"prompt_len": 3, "prompt_token_ids": [1, 2], "output_len": 3}\n', "line 1: prompt_len 3 but 2"),
        ('{"output_len": 3}\n', "line 1: give 'prompt_len' or 'prompt_token_ids'"),
        ('{"id": "a", "prompt_len": 1, "output_len": 1}\n{"id": "a", "prompt_len": 1, "output_len": 1}\n',
         "line 2: request id 'a' is used twice"),
        ("\n\n", "no requests"),
    ],
)
def test_malformed_jsonl_names_the_line(tmp_path, text, match):
    path = tmp_path / "w.jsonl"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=match):
        load_workload(str(path))


def test_impossible_budgets_name_the_setting(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_len": 10, "output_len": 2}\n{"prompt_len": 900, "output_len": 2}\n')
    with pytest.raises(SimulationError, match=r"w.jsonl line 2: a 900-token prompt .*--num-blocks 50"):
        run_once(load_jsonl(path), SimSetup(num_blocks=50))
    with pytest.raises(SimulationError, match="max_model_len is 512"):
        run_once(load_jsonl(path), SimSetup(num_blocks=500, max_model_len=512))
    with pytest.raises(SimulationError, match="below one block"):
        run_once(load_jsonl(path), SimSetup(kv_cache_memory=1000))
    with pytest.raises(WorkloadError, match="neither a built-in"):
        load_workload(str(tmp_path / "missing.jsonl"))
    with pytest.raises(Exception, match="--sweep"):
        parse_sweep("blocksize=8")
    with pytest.raises(Exception, match="--step-time"):
        StepTimeModel(0, 0, 0).with_overrides("fixed=3")


def test_bad_trace_names_the_line(tmp_path):
    path = tmp_path / "t.ndjson"
    path.write_text('{"v": 1, "seq": 0, "type": "hello", "t": 0, "num_blocks": 4, "block_size": 4}\n{oops\n')
    with pytest.raises(WorkloadError, match="line 2"):
        load_workload(str(path))


def test_cli_json_plot_and_trace_for_the_monitor(tmp_path, capsys):
    from pagedkv.cli.main import main
    from pagedkv.monitor.trace import replay

    png, trace = tmp_path / "blocks.png", tmp_path / "sim.ndjson"
    rc = main(["simulate", "--workload", "alpaca", "--num-requests", "80", "--num-blocks", "64", "--json",
               "--plot", str(png), "--trace", str(trace), "--sweep", "kv_blocks=32,64"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["paged"]["finished"] == 80 and report["static"]["finished"] == 80
    assert report["paged"]["preemptions"] > 0
    # the figure's content (axes, legend, the series it draws) is checked in test_simulate_plot.py
    assert report["plot"] == f"plot: {png}" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    state = replay(trace)  # the monitor reads the simulated run to its end, every request finished
    assert state.ended and state.num_blocks == 64 and state.gaps == 0 and state.unknown_events == {}
    assert state.stats["finished"] == 80
    assert len(state.requests) == 80 and {r.state for r in state.requests.values()} == {"finished"}
    assert {kind for kind, _, _ in state.block_map()} <= {"free", "cached"}
    rc = main(["simulate", "--num-requests", "5", "--gpu-memory", "1GiB", "--num-params", "8e9"])
    assert rc == 2
    assert "--gpu-memory" in capsys.readouterr().err
    # calibration reads a recorded trace's step times
    model = calibrate_from_trace(str(trace))
    assert all(v >= 0 and math.isfinite(v) for v in (model.fixed, model.prefill_per_token, model.decode_per_seq))


def test_progress_counts_finished_requests_for_each_run_up_to_the_total():
    calls: list[tuple[str, int, int]] = []
    wl = builtin_workload("alpaca", 300, seed=0)
    simulate(wl, SimSetup(num_blocks=2000, max_num_seqs=16), progress=lambda *a: calls.append(a),
             sweeps=[("block_size", [8])])
    for label in ("paged", "static", "block_size=8"):
        done = [d for name, d, total in calls if name == label and total == 300]
        assert len(done) >= 2 and done == sorted(done) and done[-1] == 300, label


def test_cli_no_decode_lane_reports_the_same_figures(capsys):
    from pagedkv.cli.main import main

    reports = []
    for extra in ([], ["--no-decode-lane"]):
        assert main(["simulate", "--workload", "sharegpt", "--num-requests", "60", "--num-blocks", "400",
                     "--max-num-seqs", "32", "--enable-prefix-caching", "--json", *extra]) == 0
        report = json.loads(capsys.readouterr().out)
        for run in ("paged", "static"):
            report[run].pop("wall_s")
        reports.append(report)
    assert reports[0]["paged"]["finished"] == 60
    assert reports[0] == reports[1]


def test_static_run_beside_the_paged_one_gives_the_same_report():
    wl = builtin_workload("sharegpt", 150, seed=4)
    setup = SimSetup(num_blocks=600, max_num_seqs=32, max_model_len=2048)
    reports = [simulate(wl, setup, parallel=parallel) for parallel in (False, True)]
    for report in reports:
        for run in ("paged", "static"):
            report[run].pop("wall_s")
    assert reports[0]["static"]["finished"] == 150
    assert reports[0] == reports[1]


def test_a_failure_in_the_side_run_is_raised_in_the_parent():
    from pagedkv.sim.side_run import SideRun, can_fork

    if not can_fork():
        pytest.skip("no fork on this platform")

    def broken(progress):
        raise SimulationError("the static run broke")

    with pytest.raises(SimulationError, match="static run broke"):
        SideRun(broken, report_progress=False).result()
    assert SideRun(lambda progress: {"ok": [1, 2]}, report_progress=False).result() == {"ok": [1, 2]}


_PARENT_LEAVES_EARLY = """
import sys, time
from pagedkv.cli.interrupts import raise_on_sigterm
from pagedkv.sim.side_run import SideRun

class SlowToSend(Exception):
    def __reduce__(self):  # the child is still sending its error when the parent leaves
        time.sleep(30)
        return (SlowToSend, ())


def fail(progress):
    raise SlowToSend()


raise_on_sigterm()  # as the engine command does before it starts a simulation
side = SideRun(fail, report_progress=False)
time.sleep(1.0)
print("engine: error: the paged run failed", file=sys.stderr)
sys.exit(2)  # multiprocessing terminates the daemon child at exit
"""


def test_a_side_run_ended_by_its_parents_exit_prints_nothing():
    """The flaky CI failure: simulate's one-line error, then the forked child's `Terminated` traceback."""
    import subprocess
    import sys

    from pagedkv.sim.side_run import can_fork

    if not can_fork():
        pytest.skip("no fork on this platform")
    proc = subprocess.run([sys.executable, "-c", _PARENT_LEAVES_EARLY], capture_output=True, timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert err.splitlines() == ["engine: error: the paged run failed"], err


def test_gpu_budget_counts_quantized_weight_bytes():
    cfg = load_model_config(None)
    full = gpu_kv_budget(cfg, 8 * 2**30, 0.9, "bfloat16")
    for method, per_weight in (("int8", 34 / 32), ("int4", 20 / 32), ("Q4_1", 20 / 32)):
        b = gpu_kv_budget(cfg, 8 * 2**30, 0.9, "bfloat16", quantization=method)
        assert b["weight_bytes"] == int(b["params"] * per_weight)
        assert b["kv_bytes"] == int(8 * 2**30 * 0.9) - b["weight_bytes"] > full["kv_bytes"]
    with pytest.raises(SimulationError, match="--quantization 'int3'"):
        gpu_kv_budget(cfg, 8 * 2**30, 0.9, "bfloat16", quantization="int3")


def test_cli_quantized_weights_get_the_kv_blocks_they_free(capsys):
    from pagedkv.cli.main import main

    blocks = {}
    for extra in ([], ["-q", "int8"], ["--quantization", "int4"]):
        assert main(["simulate", "--num-requests", "5", "--gpu-memory", "4GiB", "--num-params", "1e9", "--json",
                     *extra]) == 0
        report = json.loads(capsys.readouterr().out)
        blocks[tuple(extra[1:])] = report["paged"]["num_blocks"]
        per_block = report["paged"]["bytes_per_block"]
    freed = 1e9 * (2 - 34 / 32)  # bf16 weights -> Q8_0 blocks
    assert blocks[()] < blocks[("int8",)] < blocks[("int4",)]
    assert blocks[("int8",)] - blocks[()] == pytest.approx(freed / per_block, abs=1)
    assert main(["simulate", "--num-requests", "5", "-q", "awq"]) == 2
    assert "--quantization 'awq'" in capsys.readouterr().err


def test_quantized_weights_shorten_the_roofline_step():
    from pagedkv.sim.simulate import default_step_time

    full, int4 = (default_step_time(SimSetup(num_blocks=100, quantization=q)) for q in (None, "int4"))
    assert int4.fixed < full.fixed
