"""What constrained decoding costs: the decode-step time of 64 sequences under a JSON schema against the same 64
unconstrained, and the compile time of a 50-field schema.

The 64 constrained sequences each write an array of at least 40 nested objects (strings, integers, enums,
booleans), so none can finish inside the measured steps; the unconstrained ones sample the same way with
EOS ignored. Rounds alternate (A B A B ...) in fresh engines so that a shared machine's drift hits both;
each round times ``--steps`` decode steps after the prefill, by the process's CPU time (all its threads,
llguidance's included), which a loaded machine disturbs far less than wall time. The ratio is the median
constrained step over the median unconstrained one. Compile time: a new backend (its tokenizer set-up
reported apart) compiles ``--schemas`` distinct 50-field schemas; each is timed once.

    .venv/bin/python benchmarks/micro/structured_overhead.py [--model smollm2|tiny] [--rounds 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.sample.structured_output import StructuredOutputs

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "active", "tags"],
    "additionalProperties": False,
}
LONG = {"type": "array", "items": ITEM, "minItems": 40}
PROMPT = "List the users of the system as JSON:"


def fifty_fields(tag: int) -> dict:
    kinds = [{"type": "string", "maxLength": 20}, {"type": "integer", "minimum": 0}, {"type": "boolean"},
             {"enum": ["a", "b", "c"]}, {"type": "array", "items": {"type": "number"}},
             {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}, "required": ["x"]}]
    props = {f"field_{tag}_{i}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": props, "required": sorted(props)[:25], "additionalProperties": False}


def make_engine(model: str) -> Engine:
    config = dict(device="cpu", num_blocks=2048, block_size=16, max_num_seqs=64, max_num_batched_tokens=4096)
    if model == "tiny":
        from pagedkv.testing import BYTE_VOCAB, byte_tokenizer, tiny_llama

        return Engine(EngineConfig(**config), model=tiny_llama(vocab_size=BYTE_VOCAB, max_position_embeddings=2048),
                      tokenizer=byte_tokenizer())
    return Engine(EngineConfig(**config))


def step_times(model: str, constrained: bool, batch: int, steps: int) -> list[float]:
    engine = make_engine(model)
    structured = StructuredOutputs(json=LONG) if constrained else None
    if structured is not None:
        engine.check_structured(structured)  # compiled before timing (the compile has its own figure)
    for seed in range(batch):
        engine.add_request(PROMPT, SamplingParams(max_tokens=steps + 8, temperature=1.0, seed=seed,
                                                  ignore_eos=not constrained, structured=structured))
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running) or \
            engine.scheduler.waiting or engine.grammar_gate:
        engine.step()
    engine.step()  # the first decode step (warm-up)
    times = []
    for _ in range(steps):
        assert len(engine.scheduler.running) == batch, "a sequence finished inside the measured steps"
        started = time.process_time()  # CPU time of every thread (the grammar's too): steadier than wall on a
        engine.step()                  # shared machine
        times.append(time.process_time() - started)
    return times


def compile_times(model: str, count: int) -> tuple[float, list[float]]:
    engine = make_engine(model)
    started = time.perf_counter()
    engine.check_structured(StructuredOutputs(regex="warm"))  # builds the backend (tokenizer set-up)
    setup = time.perf_counter() - started
    times = []
    for tag in range(count):
        started = time.perf_counter()
        engine.check_structured(StructuredOutputs(json=fifty_fields(tag)))
        times.append(time.perf_counter() - started)
    return setup, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--schemas", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    plain: list[float] = []
    constrained: list[float] = []
    for r in range(args.rounds):
        for kind, sink in (("plain", plain), ("constrained", constrained)):
            times = step_times(args.model, kind == "constrained", args.batch, args.steps)
            sink.extend(times)
            print(f"round {r} {kind:11s} median step {statistics.median(times) * 1e3:8.1f} ms CPU", flush=True)
    ratio = statistics.median(constrained) / statistics.median(plain)
    print(f"batch {args.batch} ({args.model}): unconstrained {statistics.median(plain) * 1e3:.1f} ms, "
          f"constrained {statistics.median(constrained) * 1e3:.1f} ms CPU per step: {ratio:.3f}x")
    setup, times = compile_times(args.model, args.schemas)
    print(f"backend set-up (tokenizer) {setup * 1e3:.1f} ms; 50-field schema compile: median "
          f"{statistics.median(times) * 1e3:.2f} ms, max {max(times) * 1e3:.2f} ms over {len(times)} schemas")


if __name__ == "__main__":
    main()
