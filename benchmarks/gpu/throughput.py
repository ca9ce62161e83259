"""End to end: a Llama with a real model's shape, random bf16 weights built in-process (no weights travel),
ShareGPT-like requests; tokens/s of pagedkv on each backend against transformers ``generate`` (one padded
batch) and ``generate_batch`` (its paged continuous batching), all in this one process.

Every system gets its own copy of the model (pagedkv and transformers' continuous batching both change the
attention implementation of the model they are given), a short untimed warm-up (kernel compilation, CUDA
graph capture), then the timed requests. Each stops at its share of the worker's deadline; a run cut short
is reported as partial, with the tokens it finished.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
import time
from typing import Any

# Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, vocab 128256), positions capped for speed
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096, rope_theta=500000.0,
                tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
ATTENTION_POINT = {"gpu": ("llama1b", "bfloat16"), "dry": ("tiny", "bfloat16")}  # the kernel point of this shape
BLOCK_SIZE = 16
PAD = 0


@dataclasses.dataclass(frozen=True)
class Requests:
    prompts: list[list[int]]
    outputs: list[int]  # tokens each request generates (EOS ignored: every system does the same work)

    @property
    def output_tokens(self) -> int:
        return sum(self.outputs)


def make_requests(n: int, scale: float, max_prompt: int, max_output: int, vocab: int, seed: int = 0) -> Requests:
    """ShareGPT-like lengths (pagedkv's built-in lognormal workload), scaled by ``scale`` and capped."""
    from pagedkv.sim.workload import builtin_workload

    wl = builtin_workload("sharegpt", n, seed=seed)
    rng = random.Random(seed)
    prompts, outputs = [], []
    for r in wl.requests:
        p = max(1, min(max_prompt, round(r.prompt_len * scale)))
        prompts.append([rng.randrange(1, vocab) for _ in range(p)])
        outputs.append(max(1, min(max_output, round(r.output_len * scale))))
    return Requests(prompts, outputs)


def build_model(torch: Any, dims: dict[str, Any], device: str, dtype: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**dims, bos_token_id=None, eos_token_id=None, pad_token_id=PAD)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


# ---------------------------------------------------------------------------------------------- the systems


def run_pagedkv(torch: Any, model: Any, reqs: Requests, deadline: float, backend: str, device: str,
                dtype: str, **config: Any) -> dict[str, Any]:
    from pagedkv import LLM, SamplingParams

    need = sum(-(-(len(p) + o) // BLOCK_SIZE) for p, o in zip(reqs.prompts, reqs.outputs))
    llm = LLM(hf_model=model, device=device, backend=backend, dtype=dtype, block_size=BLOCK_SIZE,
              num_blocks=need + 64, max_num_seqs=max(256, len(reqs.prompts)), **config)
    llm.generate(reqs.prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up: kernel compilation
    engine = llm.engine
    _sync(torch, device)
    t0 = time.perf_counter()
    for p, o in zip(reqs.prompts, reqs.outputs):
        engine.add_request(p, SamplingParams(max_tokens=o, ignore_eos=True))
    finished, tokens = 0, 0
    while engine.has_unfinished() and time.time() < deadline:
        for out in engine.step(stream=False):
            if out.finished:
                finished += 1
                tokens += len(out.token_ids)
    _sync(torch, device)
    return {"finished": finished, "output_tokens": tokens, "seconds": time.perf_counter() - t0}


class _Deadline:
    """A transformers stopping criterion: stop every row once the wall clock passes ``deadline``."""

    def __init__(self, torch: Any, deadline: float) -> None:
        self.torch, self.deadline = torch, deadline

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        stop = time.time() > self.deadline
        return self.torch.full((input_ids.shape[0],), stop, dtype=self.torch.bool, device=input_ids.device)


def run_hf_generate(torch: Any, model: Any, reqs: Requests, deadline: float, device: str) -> dict[str, Any]:
    """One left-padded batch, ``max_new_tokens`` = the longest output; only each request's own tokens count."""
    from transformers import StoppingCriteriaList

    width = max(len(p) for p in reqs.prompts)
    ids = torch.full((len(reqs.prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(reqs.prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    common = dict(do_sample=False, pad_token_id=PAD, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, **common)  # warm-up
        _sync(torch, device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max(reqs.outputs),
                             stopping_criteria=StoppingCriteriaList([_Deadline(torch, deadline)]), **common)
        _sync(torch, device)
    seconds = time.perf_counter() - t0
    steps = out.shape[1] - width
    done = [min(steps, o) for o in reqs.outputs]
    return {"finished": sum(d == o for d, o in zip(done, reqs.outputs)), "output_tokens": sum(done),
            "seconds": seconds, "note": f"padded to {width} prompt + {steps} generated tokens per row"}


def _filtered(fn_or_cls: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments this transformers version accepts (the continuous batching API moves between 5.x)."""
    params = inspect.signature(fn_or_cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def run_hf_generate_batch(torch: Any, model: Any, reqs: Requests, deadline: float, device: str,
                          dry_run: bool) -> dict[str, Any]:
    """transformers' continuous batching manager, one request per prompt with its own ``max_new_tokens``."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max(reqs.outputs), do_sample=False, eos_token_id=-1, pad_token_id=PAD)
    cb_config = None
    if dry_run:  # the CPU default sizes a cache for a GPU; a small one keeps the dry run to seconds
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        cb_config = ContinuousBatchingConfig(**_filtered(ContinuousBatchingConfig, dict(
            num_blocks=64, max_batch_tokens=128, page_size=BLOCK_SIZE)))
    try:
        manager = _init_manager(model, gen, cb_config, reqs)
        if "max_new_tokens" not in inspect.signature(manager.add_request).parameters:
            raise TypeError("ContinuousBatchingManager.add_request has no max_new_tokens")
    except (AttributeError, TypeError) as exc:  # another 5.x API: the one-call form, one max_new_tokens for all
        return _generate_batch_call(torch, model, reqs, gen, device, f"{type(exc).__name__}: {exc}")
    if hasattr(manager, "warmup") and not getattr(manager, "warmed_up", True):
        manager.warmup()  # as generate_batch does: CUDA graphs captured before the clock starts
    manager.start()
    try:
        _collect(manager, [manager.add_request(p, max_new_tokens=4) for p in reqs.prompts[:2]],
                 min(deadline, time.time() + 120))
        _sync(torch, device)
        t0 = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=o) for p, o in zip(reqs.prompts, reqs.outputs)]
        results = _collect(manager, ids, deadline)
        _sync(torch, device)
        seconds = time.perf_counter() - t0
        attn = getattr(model.config, "_attn_implementation", "?")  # read before stop() may switch it back
    finally:
        manager.stop(**_filtered(manager.stop, dict(block=True, timeout=30)))
    tokens = sum(len(r.generated_tokens) for r in results.values())
    return {"finished": len(results), "output_tokens": tokens, "seconds": seconds, "note": f"attention {attn}"}


def _generate_batch_call(torch: Any, model: Any, reqs: Requests, gen: Any, device: str, why: str) -> dict[str, Any]:
    """``model.generate_batch(prompts, generation_config)``: every request runs to the longest output (no
    deadline inside); only each request's own tokens count, so this baseline is pessimistic (said in the note)."""
    model.generate_batch(reqs.prompts[:2], gen.__class__(**{**gen.to_dict(), "max_new_tokens": 4}))
    _sync(torch, device)
    t0 = time.perf_counter()
    out = model.generate_batch(reqs.prompts, gen)
    _sync(torch, device)
    seconds = time.perf_counter() - t0
    done = [min(len(r.generated_tokens), o) for r, o in zip(out.values(), reqs.outputs)]
    return {"finished": sum(d == o for d, o in zip(done, reqs.outputs)), "output_tokens": sum(done),
            "seconds": seconds, "note": f"one-call generate_batch, every request to {gen.max_new_tokens} ({why})"[:200]}


def _init_manager(model: Any, gen: Any, cb_config: Any, reqs: Requests) -> Any:
    """``init_continuous_batching`` with as many of our arguments as this transformers takes."""
    attempts = [dict(generation_config=gen, continuous_batching_config=cb_config, workload_hints=_hints(reqs)),
                dict(generation_config=gen, continuous_batching_config=cb_config), dict(generation_config=gen)]
    error: Exception | None = None
    for kwargs in attempts:
        kwargs = {k: v for k, v in _filtered(model.init_continuous_batching, kwargs).items() if v is not None}
        try:
            return model.init_continuous_batching(**kwargs)
        except TypeError as exc:  # a keyword this version does not know
            error = exc
    raise error


def _hints(reqs: Requests) -> Any:
    """The sizes generate_batch would pass (None where this transformers has no WorkloadHints)."""
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return None
    return WorkloadHints(**_filtered(WorkloadHints, dict(max_prompt_length=max(map(len, reqs.prompts)),
                                                         max_generated_length=max(reqs.outputs),
                                                         num_requests=len(reqs.prompts))))


def _collect(manager: Any, ids: list[str], deadline: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    while len(results) < len(ids) and time.time() < deadline:
        r = manager.get_result(timeout=0.2)
        if r is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped (see the worker log)")
            continue
        if _is_finished(r):
            results[r.request_id] = r
    return results


def _is_finished(result: Any) -> bool:
    if hasattr(result, "is_finished"):
        return bool(result.is_finished())
    return str(getattr(result, "status", "")).upper().endswith("FINISHED")


def _sync(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
