"""Equal work (issue 20) in one process: transformers ``generate`` against pagedkv ``cpu``, optionally also with an
older build of the kernel, interleaved, with the time spent inside attention.

Run: ``.venv/bin/python benchmarks/e2e/equal_work_ab.py --batch 8 --prompt-len 2048 --rounds 2 [--old-lib OLD.so]
[--torch]``.
An old library is built from an earlier commit's source, e.g. ``git show REV:backends/cpu/attention.cpp >
/tmp/old.cpp && g++ -O3 -march=native -fopenmp -fPIC -shared -std=c++17 /tmp/old.cpp -o /tmp/old.so`` (copy any
header it includes beside it). The prompts, the ``generate`` call and the pagedkv call are those of
``test_equal_work.py``; one torch thread; times are process CPU time and wall; "attention" is the thread CPU time
inside SDPA calls (generate) or the backend's ``attend`` calls (pagedkv), decode included.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common, workload, paged_case


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--old-lib", help="a kernel library built from an earlier source, run as 'old'")
    parser.add_argument("--torch", action="store_true", help="also pagedkv with the torch reference backend")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import test_equal_work as ew
    import transformers.integrations.sdpa_attention as sdpa_module
    from bench_common import ContentionMonitor, Timers, load_hf_model, model_dir
    from transformers import AutoTokenizer

    from pagedkv import LLM
    from pagedkv.backends.cpu.build import _bind

    path = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    pad_id = tokenizer.eos_token_id
    hf, paged = load_hf_model(path), load_hf_model(path)
    prompts = ew.prompts_of(args.batch, args.prompt_len, hf.config.vocab_size)
    timers = Timers()  # this thread's CPU seconds inside attention (SDPA and the engines' backends) as "s"
    attention = timers.cpu
    sdpa_module.torch.nn.functional.scaled_dot_product_attention = timers.timed(
        torch.nn.functional.scaled_dot_product_attention, "s")
    systems = {"generate": lambda ps: ew.run_generate(hf, ps, pad_id)}
    libs = {"new": None, **({"old": _bind(ctypes.CDLL(args.old_lib))} if args.old_lib else {})}
    for name, lib in libs.items():
        llm = LLM(hf_model=paged, tokenizer=tokenizer, device="cpu", backend="cpu")
        if lib is not None:
            llm.engine.backend.lib = lib
        llm.engine.backend.attend = timers.timed(llm.engine.backend.attend, "s")
        systems[name] = lambda ps, llm=llm: ew.run_pagedkv(llm, ps)
    if args.torch:
        llm = LLM(hf_model=paged, tokenizer=tokenizer, device="cpu", backend="torch")
        llm.engine.backend.attend = timers.timed(llm.engine.backend.attend, "s")
        systems["torch"] = lambda ps, llm=llm: ew.run_pagedkv(llm, ps)
    for run in systems.values():
        run(prompts[:2])  # warm-up: lazy initialisation and the kernel build are not timed

    print(f"B={args.batch}, P={args.prompt_len}, N={ew.NEW_TOKENS}, 1 torch thread; {ew.facts()}")
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    reference = None
    for r in range(args.rounds):
        for name, run in systems.items():
            timers.reset()
            with ContentionMonitor() as c:
                wall, cpu = time.perf_counter(), time.process_time()
                got = run(prompts)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            reference = reference or got
            same = sum(a == b for a, b in zip(got, reference))
            for i, v in enumerate((cpu, wall, attention["s"])):
                totals[name][i] += v
            print(f"round {r} {name:<8} cpu {cpu:6.1f} s  wall {wall:6.1f} s  attention {attention['s']:5.1f} s  "
                  f"identical to generate {same}/{len(reference)}  load {c.load_before[0]:.1f}, "
                  f"others {100 * c.others_share:.0f}%", flush=True)
    base_cpu, base_wall = totals["generate"][0], totals["generate"][1]
    for name, (cpu, wall, att) in totals.items():
        print(f"total {name:<8} cpu {cpu:6.1f} s ({base_cpu / cpu:.2f}x generate)  wall {wall:6.1f} s "
              f"({base_wall / wall:.2f}x)  attention {att:5.1f} s  rest {cpu - att:5.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
