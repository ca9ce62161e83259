"""End to end on SmolLM2-135M-Instruct (fp32, CPU): pagedkv vs transformers' ``generate``
(padded static batches) vs transformers' ``generate_batch`` (its paged continuous batching).

One workload (see ``workload.py``): 32 chat prompts, output lengths 8..128 drawn with a
fixed seed, greedy, EOS ignored. Throughput = useful generated tokens / wall time.
Ratios are taken against the baselines measured earlier in the same session.

Run: ``python -m pytest benchmarks/e2e/test_e2e_smollm2.py --benchmark-only -s``
(``-k "not profile"`` skips the profile; ``-k sweep`` runs only the concurrency sweep: 1, 8, 32 and
128 requests through all three systems, then writes ``plots/tokens_per_s_vs_concurrency.png``).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Any

import pytest
import torch
from bench_common import PLOTS, ContentionMonitor, Row, Timers, machine_info

GENERATE_BATCH_SIZES = (8, 32)

# outputs of the main run of every system, for the agreement check
_OUTPUTS: dict[str, list[list[int]]] = {}


# --- the three ways -----------------------------------------------------------------------------


def make_llm(model: Any, tokenizer: Any) -> Any:
    from pagedkv import LLM

    return LLM(hf_model=model, tokenizer=tokenizer, device="cpu", block_size=16, kv_cache_memory="1GiB")


def run_pagedkv(llm: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    from pagedkv import SamplingParams

    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate(prompts, params)
    return [list(o.token_ids) for o in outs]


def run_generate(
    model: Any, pad_id: int, prompts: list[list[int]], max_tokens: list[int], batch_size: int
) -> tuple[list[list[int]], int]:
    """transformers ``generate``, static batches in arrival order, left padding; each batch runs to its
    longest request. Returns each request's first ``n_i`` tokens and the raw number generated."""
    outputs: list[list[int]] = []
    raw = 0
    for start in range(0, len(prompts), batch_size):
        batch, lens = prompts[start : start + batch_size], max_tokens[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        steps = max(lens)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                eos_token_id=None, pad_token_id=pad_id,
            )
        new = out[:, width:]
        assert new.shape[1] == steps, "generate stopped early: EOS was not ignored"
        raw += new.numel()
        outputs.extend(new[i, :n].tolist() for i, n in enumerate(lens))
    return outputs, raw


class GenerateBatchRunner:
    """transformers' continuous batching, driven the way ``generate_batch`` drives it.

    ``generate_batch(inputs, max_new_tokens=...)`` takes one length for all requests, so
    this makes the same calls it makes (``init_continuous_batching``, ``warmup``, ``start``,
    ``add_request``, ``get_result``) with each request's own ``max_new_tokens`` and
    ``eos_token_id=-1`` (no EOS). Setup and warm-up are outside the timed part, as
    pagedkv's KV allocation is.
    """

    def __init__(self, model: Any, pad_id: int, max_prompt: int, max_new: int) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.gen_config = GenerationConfig(
            do_sample=False, max_new_tokens=max_new, eos_token_id=-1, pad_token_id=pad_id
        )
        # Same budgets as pagedkv: ~1 GiB of KV, 2048 batched tokens per step.
        self.cb_config = ContinuousBatchingConfig(num_blocks=90, max_batch_tokens=2048)
        self.model = model
        self.setup_s = 0.0

    def __enter__(self) -> GenerateBatchRunner:
        started = time.perf_counter()
        self.manager = self.model.init_continuous_batching(
            generation_config=self.gen_config, continuous_batching_config=self.cb_config
        )
        self.manager.warmup()
        self.manager.start()
        self.setup_s = time.perf_counter() - started
        return self

    def __exit__(self, *exc: Any) -> None:
        self.manager.stop(block=True, timeout=10)
        self.manager.destroy()
        self.model.set_attn_implementation("sdpa")

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        ids = [
            self.manager.add_request(p, request_id=f"r{i}_{time.monotonic_ns()}", max_new_tokens=n, eos_token_id=-1)
            for i, (p, n) in enumerate(zip(prompts, max_tokens))
        ]
        results: dict[str, Any] = {}
        while len(results) < len(ids):
            result = self.manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not self.manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
        outs = [list(results[i].generated_tokens) for i in ids]
        for out, n in zip(outs, max_tokens):
            assert len(out) == n, f"generate_batch produced {len(out)} tokens, wanted {n}"
        return outs


# --- helpers ------------------------------------------------------------------------------------------


def _time(benchmark: Any, fn: Any) -> tuple[Any, float, Any]:
    """One timed round under pytest-benchmark's pedantic mode, with the contention monitor around it."""
    box: dict[str, Any] = {}

    def target() -> None:
        with ContentionMonitor() as c:
            started = time.perf_counter()
            box["result"] = fn()
            box["wall"] = time.perf_counter() - started
        box["contention"] = c

    benchmark.pedantic(target, rounds=1, iterations=1, warmup_rounds=0)
    return box["result"], box["wall"], box["contention"]


def _record(benchmark: Any, report: Any, system: str, n_req: int, useful: int, raw: int, wall: float, c: Any) -> Row:
    row = Row(system, n_req, useful, raw, wall, c)
    report.add(row)
    benchmark.extra_info.update(
        {
            "system": system,
            "requests": n_req,
            "useful_tokens": useful,
            "raw_generated_tokens": raw,
            "wall_s": round(wall, 3),
            "useful_tokens_per_s": round(row.tokens_per_s, 2),
            **c.as_dict(),
            "machine": machine_info(),
        }
    )
    print(f"\n{system}: {useful} useful tokens ({raw} raw) in {wall:.2f} s = {row.tokens_per_s:.1f} tok/s; "
          f"load {c.load_before[0]:.2f}, others used {100 * c.others_share:.0f}% of the machine")
    return row


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Requests with identical tokens, and the mean fraction of tokens before the first difference."""
    same, prefix = 0, 0.0
    for x, y in zip(a, b):
        same += x == y
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix += k / max(len(x), 1)
    return {"identical_requests": same, "of": len(a), "mean_agreeing_prefix": round(prefix / len(a), 3)}


@pytest.fixture(scope="module")
def pad_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


@pytest.fixture(scope="module")
def warm(hf_model: Any, paged_model: Any, tokenizer: Any, workload: Any, pad_id: int) -> None:
    """Run each path once on two short requests, so lazy initialisation is not timed."""
    prompts, lens = workload.prompt_ids[:2], [4, 4]
    run_generate(hf_model, pad_id, prompts, lens, 2)
    run_pagedkv(make_llm(paged_model, tokenizer), prompts, lens)


# --- the main comparison -----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", GENERATE_BATCH_SIZES)
def test_e2e_generate(benchmark, e2e_report, warm, hf_model, workload, pad_id, batch_size):
    outs, wall, c = _time(
        benchmark, lambda: run_generate(hf_model, pad_id, workload.prompt_ids, workload.max_tokens, batch_size)
    )
    outs, raw = outs
    _OUTPUTS[f"generate_bs{batch_size}"] = outs
    _record(benchmark, e2e_report, f"hf generate (static bs={batch_size})", len(workload), workload.output_tokens,
            raw, wall, c)


def test_e2e_generate_batch(benchmark, e2e_report, warm, hf_model, workload, pad_id):
    max_prompt = max(len(p) for p in workload.prompt_ids)
    with GenerateBatchRunner(hf_model, pad_id, max_prompt, max(workload.max_tokens)) as runner:
        runner.run(workload.prompt_ids[:2], [4, 4])  # warm the running manager
        outs, wall, c = _time(benchmark, lambda: runner.run(workload.prompt_ids, workload.max_tokens))
    _OUTPUTS["generate_batch"] = outs
    benchmark.extra_info["setup_and_warmup_s_untimed"] = round(runner.setup_s, 2)
    _record(benchmark, e2e_report, "hf generate_batch (paged CB)", len(workload), workload.output_tokens,
            workload.output_tokens, wall, c)


def test_e2e_pagedkv(benchmark, e2e_report, warm, paged_model, hf_model, tokenizer, workload):
    llm = make_llm(paged_model, tokenizer)
    outs, wall, c = _time(benchmark, lambda: run_pagedkv(llm, workload.prompt_ids, workload.max_tokens))
    _OUTPUTS["pagedkv"] = outs
    assert [len(o) for o in outs] == workload.max_tokens
    row = _record(benchmark, e2e_report, f"pagedkv ({llm.engine.config.backend} backend, bs16)", len(workload),
                  workload.output_tokens,
                  workload.output_tokens, wall, c)
    engine = llm.engine
    benchmark.extra_info.update(
        {"engine_steps": engine.stats.steps, "peak_running": engine.stats.peak_running,
         "preemptions": engine.stats.preemptions}
    )

    # Ratios against the baselines measured earlier in this session.
    baselines = {k: v for k, v in e2e_report.rows.items() if k.startswith("hf ")}
    ratios = {}
    for name, base in baselines.items():
        ratios[name] = row.tokens_per_s / base.tokens_per_s
        e2e_report.notes.append(f"pagedkv / {name}: {ratios[name]:.2f}x")
    static = {k: v for k, v in ratios.items() if "static" in k}
    if static:
        best = min(static, key=lambda k: static[k])  # the fastest generate gives the smallest ratio
        benchmark.extra_info["ratio_vs_generate_best"] = round(static[best], 3)
        benchmark.extra_info["generate_best_config"] = best
    if "hf generate_batch (paged CB)" in ratios:
        benchmark.extra_info["ratio_vs_generate_batch"] = round(ratios["hf generate_batch (paged CB)"], 3)
    benchmark.extra_info["ratios"] = {k: round(v, 3) for k, v in ratios.items()}

    # Sanity (not timing): pagedkv's greedy tokens equal transformers' unpadded generate.
    reference, _ = run_generate(hf_model, 0, workload.prompt_ids[:4], workload.max_tokens[:4], 1)
    assert outs[:4] == reference, "pagedkv's greedy output differs from transformers' generate"
    agreement = {name: _agreement(outs, other) for name, other in _OUTPUTS.items() if name != "pagedkv"}
    benchmark.extra_info["agreement_with_pagedkv"] = agreement
    e2e_report.notes.append("sanity: pagedkv == unpadded hf generate on the first 4 prompts (token-identical)")
    for name, a in agreement.items():
        e2e_report.notes.append(
            f"agreement pagedkv vs {name}: {a['identical_requests']}/{a['of']} requests identical, "
            f"mean agreeing prefix {a['mean_agreeing_prefix']:.3f}"
        )


# --- concurrency sweep: where continuous batching pays --------------------------------------------------
#
# n = 1, 8, 32, 128 requests, all three systems, in one session. The requests are the first n of a
# 128-request workload built by the same function with the same seed (``build_workload(tok, 128)``: the
# 40 chat texts cycled in the seeded order, 128 lengths drawn from 8..128); its first 32 requests are
# exactly the main workload. ``generate`` runs static batches of at most SWEEP_STATIC_CAP requests in
# arrival order (n <= 32: one padded batch of n; n = 128: four batches of 32, the main comparison's best
# batch size), plus, at n = 128 only, one padded batch of all 128 for reference. The summary (ratios and
# ``plots/tokens_per_s_vs_concurrency.png``) is written when the module's tests end.

SWEEP_SIZES = (1, 8, 32, 128)
SWEEP_STATIC_CAP = 32
SWEEP_SYSTEMS = ("generate", "generate_batch", "pagedkv")
_SWEEP_CASES = [(n, s) for n in SWEEP_SIZES for s in SWEEP_SYSTEMS] + [(128, "generate_one_batch")]
_SWEEP_LABELS = {
    "generate": f"hf generate (static batches of <= {SWEEP_STATIC_CAP})",
    "generate_one_batch": "hf generate (one static batch of n)",
    "generate_batch": "hf generate_batch (paged CB)",
    "pagedkv": "pagedkv (default backend, bs16)",
}
PLOT_PATH = PLOTS / "tokens_per_s_vs_concurrency.png"


@pytest.fixture(scope="module")
def sweep_workload(tokenizer: Any, workload: Any) -> Any:
    from workload import build_workload

    big = build_workload(tokenizer, num_requests=max(SWEEP_SIZES))
    main = big.take(len(workload))
    assert main.prompt_ids == workload.prompt_ids and main.max_tokens == workload.max_tokens
    return big


@pytest.fixture(scope="module")
def sweep_rows(e2e_report: Any) -> Any:
    rows: dict[tuple[str, int], Row] = {}
    yield rows
    if rows:
        _sweep_summary(rows, e2e_report)


def _sweep_summary(rows: dict[tuple[str, int], Row], report: Any) -> None:
    print("\n=== concurrency sweep: useful tokens/s ===")
    for n in sorted({n for _, n in rows}):
        cells = {s: rows[(s, n)].tokens_per_s for s in _SWEEP_LABELS if (s, n) in rows}
        line = ", ".join(f"{s} {v:.1f}" for s, v in cells.items())
        if "pagedkv" in cells:
            ratios = ", ".join(
                f"pagedkv/{s} {cells['pagedkv'] / v:.2f}x" for s, v in cells.items() if s != "pagedkv"
            )
            line += f"; {ratios}"
        print(f"n={n}: {line}")
        report.notes.append(f"sweep n={n}: {line}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, marker in (("pagedkv", "o"), ("generate_batch", "s"), ("generate", "^")):
        pts = sorted((n, r.tokens_per_s) for (s, n), r in rows.items() if s == system)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=_SWEEP_LABELS[system])
    one = [(n, r.tokens_per_s) for (s, n), r in rows.items() if s == "generate_one_batch"]
    if one:
        ax.plot([p[0] for p in one], [p[1] for p in one], "v", color="grey", linestyle="none",
                label="hf generate (one static batch of 128)")
    ax.set_xscale("log")
    sizes = sorted({n for _, n in rows})
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.minorticks_off()
    ax.set_xlabel("requests (submitted at once)")
    ax.set_ylabel("useful tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    threads = torch.get_num_threads()
    ax.set_title(f"SmolLM2-135M-Instruct fp32, CPU ({os.cpu_count()} cores, {threads} torch threads)\n"
                 "chat prompts, output 8..128 tokens, greedy, EOS ignored", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    PLOT_PATH.parent.mkdir(exist_ok=True)
    fig.savefig(PLOT_PATH, dpi=120)
    plt.close(fig)
    print(f"plot: {PLOT_PATH}")


@pytest.mark.parametrize(("n", "system"), _SWEEP_CASES, ids=[f"{s}-{n}" for n, s in _SWEEP_CASES])
def test_sweep(benchmark, e2e_report, sweep_rows, warm, hf_model, paged_model, tokenizer, sweep_workload, pad_id,
               system, n):
    sub = sweep_workload.take(n)
    extra: dict[str, Any] = {}
    if system in ("generate", "generate_one_batch"):
        bs = n if system == "generate_one_batch" else min(n, SWEEP_STATIC_CAP)
        (_, raw), wall, c = _time(
            benchmark, lambda: run_generate(hf_model, pad_id, sub.prompt_ids, sub.max_tokens, bs)
        )
        extra["static_batch_size"] = bs
    elif system == "generate_batch":
        max_prompt = max(len(p) for p in sub.prompt_ids)
        with GenerateBatchRunner(hf_model, pad_id, max_prompt, max(sub.max_tokens)) as runner:
            runner.run(sub.prompt_ids[:2], [4, 4])  # warm the running manager
            _, wall, c = _time(benchmark, lambda: runner.run(sub.prompt_ids, sub.max_tokens))
        raw = sub.output_tokens
        extra["setup_and_warmup_s_untimed"] = round(runner.setup_s, 2)
    else:
        llm = make_llm(paged_model, tokenizer)
        _, wall, c = _time(benchmark, lambda: run_pagedkv(llm, sub.prompt_ids, sub.max_tokens))
        raw = sub.output_tokens
        stats = llm.engine.stats
        extra.update(engine_steps=stats.steps, peak_running=stats.peak_running, preemptions=stats.preemptions)
    row = _record(benchmark, e2e_report, f"sweep n={n}: {_SWEEP_LABELS[system]}", n, sub.output_tokens, raw, wall,
                  c)
    benchmark.extra_info.update(extra)
    print(f"  load after {c.load_after[0]:.2f}; {extra}")
    sweep_rows[(system, n)] = row


# --- where pagedkv's step time goes ----------------------------------------------------------------------------


def instrument(llm: Any) -> Timers:
    """Wrap the engine's parts (instance attributes only; the classes are untouched)."""
    timers = Timers()
    e = llm.engine
    parts = (
        (e, "step", "step"),
        (e.scheduler, "schedule", "schedule"),
        (e.runner, "execute", "execute"),
        (e.runner, "build_metadata", "metadata"),
        (e.runner.model, "forward", "forward"),
        (e.backend, "write_kv", "write_kv"),
        (e.backend, "attend", "attend"),
        (e.scheduler, "update_from_output", "update"),
        (e.sampler, "sample", "sample"),
        (e, "_observe", "observe"),
        (e.outputs, "emit", "make_output"),
    )
    for obj, attr, name in parts:
        timers.patch(obj, attr, name, record=f"pagedkv::{name}")
    return timers


def breakdown(timers: Timers, total: float) -> list[tuple[str, float]]:
    s = timers.wall
    parts = [
        ("scheduling (scheduler.schedule)", s["schedule"]),
        ("metadata (runner.build_metadata)", s["metadata"]),
        ("input prep (runner.execute minus metadata, forward)", s["execute"] - s["metadata"] - s["forward"]),
        ("attention backend: write_kv", s["write_kv"]),
        ("attention backend: attend", s["attend"]),
        ("model forward minus attention backend", s["forward"] - s["write_kv"] - s["attend"]),
        ("sampling (sampler.sample)", s["sample"]),
        ("update/finish (scheduler.update_from_output)", s["update"]),
        ("stats (_observe)", s["observe"]),
        ("outputs/detokenize (outputs.emit)", s["make_output"]),
        ("rest of engine.step", s["step"] - s["schedule"] - s["execute"] - s["sample"] - s["update"]
         - s["observe"] - s["make_output"]),
        ("LLM.generate outside step", total - s["step"]),
    ]
    return parts


_SCOPES = ("attend", "write_kv", "metadata", "schedule", "sample", "forward")


def op_table(prof: Any) -> dict[str, list[tuple[str, float, int]]]:
    """Self CPU time per aten op, grouped by the innermost pagedkv scope it ran under."""
    groups: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for evt in prof.events():
        if evt.name.startswith("pagedkv::"):
            continue
        scope, parent = "other", evt.cpu_parent
        while parent is not None:
            if parent.name.startswith("pagedkv::") and parent.name[9:] in _SCOPES:
                scope = parent.name[9:]
                break
            parent = parent.cpu_parent
        entry = groups[scope][evt.name]
        entry[0] += evt.self_cpu_time_total / 1e6
        entry[1] += 1
    return {
        scope: sorted(((op, t, n) for op, (t, n) in ops.items()), key=lambda x: -x[1])
        for scope, ops in groups.items()
    }


def test_profile_pagedkv(benchmark, warm, paged_model, tokenizer, workload):
    # 1. wall-clock split with cheap perf_counter wrappers (no profiler running)
    llm = make_llm(paged_model, tokenizer)
    timers = instrument(llm)
    _, wall, c = _time(benchmark, lambda: run_pagedkv(llm, workload.prompt_ids, workload.max_tokens))
    steps = timers.calls["step"]
    print(f"\n=== pagedkv step-time breakdown: {steps} steps, {wall:.2f} s, "
          f"{workload.output_tokens / wall:.1f} tok/s, load {c.load_before[0]:.2f}, "
          f"others {100 * c.others_share:.0f}% ===")
    parts = breakdown(timers, wall)
    for name, sec in parts:
        print(f"{name:<55} {sec:8.3f} s {100 * sec / wall:6.1f}%  {1e3 * sec / steps:7.2f} ms/step")
    benchmark.extra_info["breakdown_s"] = {name: round(sec, 4) for name, sec in parts}
    benchmark.extra_info["steps"] = steps
    benchmark.extra_info.update(c.as_dict())

    # 2. op-level split of the same workload under torch.profiler (slower; shares only)
    llm = make_llm(paged_model, tokenizer)
    instrument(llm)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_pagedkv(llm, workload.prompt_ids, workload.max_tokens)
    table = op_table(prof)
    total = sum(t for ops in table.values() for _, t, _ in ops)
    print(f"\n=== torch.profiler self CPU time by scope and op (total {total:.2f} s, profiler on) ===")
    summary = {}
    for scope, ops in sorted(table.items(), key=lambda kv: -sum(t for _, t, _ in kv[1])):
        scope_total = sum(t for _, t, _ in ops)
        summary[scope] = {"share": round(scope_total / total, 4), "top_ops": {}}
        print(f"[{scope}] {scope_total:.2f} s ({100 * scope_total / total:.1f}%)")
        for op, t, n in ops[:8]:
            summary[scope]["top_ops"][op] = round(t, 4)
            print(f"    {op:<45} {t:8.3f} s {100 * t / total:6.1f}%  calls {n}")
    benchmark.extra_info["profiler_self_cpu"] = summary
