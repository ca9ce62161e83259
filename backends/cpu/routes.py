"""Which phases the compiled kernel runs and which go to torch, per build: ``auto`` must never pick a path
slower than torch for a phase on the machine it runs on, and never decide from a machine that was busy.

The AVX-512 and AVX2 builds are known by their features: their register-tiled attention and linear kernels
beat torch (and oneDNN) wherever they were served side by side (``docs/cpu_kernels.md``), so they
take no measurement. Any other build (plain x86-64, non-x86 ``-march=native``) is measured once against
torch on SmolLM2's real layer shapes and cached beside the library, unless the machine was shared while it
measured: then this start runs the kernel and the next one measures again. ``$PAGEDKV_CPU_ROUTES`` forces
the routes (``kernel``, ``torch``, ``measure``, or per phase: ``decode=kernel,prefill=torch,linear=torch``).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from pagedkv.backends.cpu.route_table import KERNEL, TORCH, Routes
from pagedkv.core.errors import ConfigError

log = logging.getLogger("pagedkv")

ENV = "PAGEDKV_CPU_ROUTES"
FAST_BY_FEATURES = ("avx512-bf16", "avx512", "avx2-vnni", "avx2")
# torch takes a phase only when the kernel is this much slower: a near tie keeps the kernel
MARGIN = 1.10
# our CPU time over wall time x threads while measuring; below it another process had a share of the cores
QUIET_SHARE = 0.8
PHASES = tuple(f.name for f in fields(Routes))
# One SmolLM2-135M layer's linears (out, in): q, k, v, o, gate, up, down.
LAYER_SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))


@dataclass
class Measurement:
    """A measured verdict: the routes, the median seconds of each case by each path, and how much of the
    cores this process had while it measured."""

    routes: Routes
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    cpu_share: float = 1.0

    @property
    def quiet(self) -> bool:
        return self.cpu_share >= QUIET_SHARE

    def describe(self) -> str:
        cases = ", ".join(f"{case} {t[KERNEL] * 1e3:.2f} vs {t[TORCH] * 1e3:.2f} ms"
                          for case, t in self.seconds.items())
        return f"kernel vs torch: {cases or 'nothing measured'}; cpu share {self.cpu_share:.2f}"


def requested(value: str | None = None) -> Routes | str:
    """``$PAGEDKV_CPU_ROUTES`` read: ``"auto"`` (unset), ``"measure"``, or the forced :class:`Routes`."""
    text = (os.environ.get(ENV, "") if value is None else value).strip().lower()
    if text in ("", "auto", "measure"):
        return text or "auto"
    if text in (KERNEL, TORCH):
        return Routes(**dict.fromkeys(PHASES, text))
    chosen = {}
    for part in text.split(","):
        phase, _, route = part.partition("=")
        phase, route = phase.strip(), route.strip()
        if phase not in PHASES or route not in (KERNEL, TORCH) or phase in chosen:
            raise ConfigError(f"{ENV}={text!r}: expected auto, measure, kernel, torch, or a list such as "
                              f"'decode=kernel,prefill=torch,linear=kernel' (phases {', '.join(PHASES)})")
        chosen[phase] = route
    return Routes(**chosen)


def default_routes(lib) -> Routes:  # noqa: ANN001 - a ctypes library from build.load
    """The routes of a loaded build, cached beside its library (a library bound by hand runs the kernel
    unless ``$PAGEDKV_CPU_ROUTES`` says otherwise)."""
    from pagedkv.backends.cpu import build

    isa = getattr(lib, "isa", None)  # (None: a library bound by hand, e.g. an older build for A/B runs)
    mode = requested()
    if isa is None:
        return mode if isinstance(mode, Routes) else Routes()
    return routes_for(lib, isa, build.library_path(isa).with_suffix(".routes.json"), mode)


def routes_for(lib, isa: str, cache_file: Path | None, mode: Routes | str = "auto") -> Routes:  # noqa: ANN001
    """The routes of the ``isa`` build: forced, by features, else the cached (or a fresh) measurement."""
    if isinstance(mode, Routes):
        log.debug("pagedkv: the %s CPU kernel build runs %s (%s)", isa, _describe(mode), ENV)
        return mode
    if mode == "auto" and isa in FAST_BY_FEATURES:
        return Routes()
    if mode == "auto" and cache_file is not None and cache_file.exists():
        try:
            return Routes(**json.loads(cache_file.read_text()))
        except (ValueError, TypeError):
            log.warning("pagedkv: ignoring an unreadable kernel route cache %s", cache_file)
    measured = measure(lib)
    if not measured.quiet:
        log.info("pagedkv: the %s CPU kernel build runs every phase by the kernel for now: the machine was busy "
                 "while measuring (%s); the next start measures again", isa, measured.describe())
        return Routes()
    log.info("pagedkv: the %s CPU kernel build runs %s (measured: %s)", isa, _describe(measured.routes),
             measured.describe())
    if cache_file is not None:
        write_atomically(cache_file, json.dumps(asdict(measured.routes)))
    return measured.routes


def write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file of this writer's own, renamed over it: concurrent
    writers (two engines starting at once, the ranks of a tensor-parallel run) never collide."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def measure(lib, rounds: int = 5, attention: bool = True, linear: bool = True) -> Measurement:  # noqa: ANN001
    """Kernel against torch, the median of ``rounds`` alternating rounds (wall clock). Attention on a prefill
    (1 x 512 tokens) and a decode (16 x 256 context) of SmolLM2's attention shape; linears on 1, 16 and 256
    rows through six of SmolLM2's layers (85 MB of random weights, from memory as in a step) against oneDNN
    (MKL without it). A phase not measured keeps the kernel; torch takes one only past :data:`MARGIN`."""
    clock = _Clock()
    seconds: dict[str, dict[str, float]] = {}
    verdict = {}
    if attention:
        for phase, case in _attention_cases(lib).items():
            seconds[phase] = _alternate(case, rounds, clock)
            verdict[phase] = _pick([seconds[phase]])
    if linear:
        cases = _linear_cases(lib)
        if cases is None:
            verdict["linear"] = TORCH
        else:
            by_rows = {f"linear {rows} rows": _alternate(case, rounds, clock) for rows, case in cases.items()}
            seconds.update(by_rows)
            verdict["linear"] = _pick(list(by_rows.values()))
    return Measurement(Routes(**verdict), seconds, clock.share())


class _Clock:
    """Wall time and this process's CPU time over the timed calls only (not the set-up between them)."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def time(self, run) -> float:  # noqa: ANN001 - a no-argument callable
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        elapsed = time.perf_counter() - wall
        self.wall += elapsed
        self.cpu += time.process_time() - cpu
        return elapsed

    def share(self) -> float:
        """CPU time over wall time x threads: ~1 when every thread had a core to itself."""
        if self.wall <= 0:
            return 1.0
        return min(1.0, self.cpu / (self.wall * max(1, torch.get_num_threads())))


def _pick(cases: list[dict[str, float]]) -> str:
    """torch when the kernel is slower past the margin over the cases taken together (geometric mean)."""
    ratio = statistics.geometric_mean([c[KERNEL] / c[TORCH] for c in cases])
    return TORCH if ratio > MARGIN else KERNEL


def _alternate(case: dict, rounds: int, clock: _Clock) -> dict[str, float]:
    """Median seconds of each path of ``case`` (name -> no-argument callable), run in turn each round so a
    neighbour's burst hits both alike; one warm-up call each first."""
    for run in case.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in case}
    for _ in range(rounds):
        for name, run in case.items():
            times[name].append(clock.time(run))
    return {name: statistics.median(t) for name, t in times.items()}


def _attention_cases(lib) -> dict[str, dict]:  # noqa: ANN001
    from pagedkv.backends.cpu.backend import CpuBackend
    from pagedkv.backends.torch_ref import TorchBackend

    kernel, ref = CpuBackend(lib, routes=Routes()), TorchBackend("cpu")
    cases = {}
    for phase, lens, q_lens in (("prefill", [512], [512]), ("decode", [256] * 16, [1] * 16)):
        args = _attention_inputs(lens, q_lens)
        cases[phase] = {KERNEL: lambda a=args: kernel.attend(*a), TORCH: lambda a=args: ref.attend(*a)}
    return cases


def _linear_cases(lib) -> dict[int, dict] | None:  # noqa: ANN001
    from pagedkv.backends.cpu.linear import CpuLinearKernel, usable
    from pagedkv.core.model import cpu_linear

    if not usable(lib):
        return None
    kernel = CpuLinearKernel(lib)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen) * 0.02 for _ in range(6) for shape in LAYER_SHAPES]
    ours = [(kernel.pack(w), w.shape[0]) for w in weights]
    onednn = [cpu_linear.onednn_pack(w) for w in weights] if cpu_linear.available() else None

    def run_ours(x: dict[int, torch.Tensor]) -> None:
        for (pack, out_features), w in zip(ours, weights):
            kernel.linear(x[w.shape[1]], pack, None, out_features)

    def run_torch(x: dict[int, torch.Tensor]) -> None:  # as PackedLinear runs them (one row: MKL's gemv)
        for i, w in enumerate(weights):
            if onednn is None or x[w.shape[1]].shape[0] < cpu_linear.MIN_ROWS:
                torch.nn.functional.linear(x[w.shape[1]], w)
            else:
                torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], onednn[i], None, "none", [], "")

    cases = {}
    for rows in (1, 16, 256):
        x = {n: torch.randn(rows, n, generator=gen) for n in {s[1] for s in LAYER_SHAPES}}
        cases[rows] = {KERNEL: lambda x=x: run_ours(x), TORCH: lambda x=x: run_torch(x)}
    return cases


def _describe(routes: Routes) -> str:
    return ", ".join(f"{phase} by {getattr(routes, phase)}" for phase in PHASES)


def _attention_inputs(lens: list[int], q_lens: list[int]) -> tuple:
    from pagedkv.core.kv.attention_metadata import AttentionMetadata

    block, heads, kv_heads, dim = 16, 9, 3, 64
    gen = torch.Generator().manual_seed(0)
    tables, first = [], 0
    for n in lens:
        count = -(-n // block)
        tables.append(list(range(first, first + count)))
        first += count
    k_cache = torch.randn(first, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(first, block, kv_heads, dim, generator=gen)
    query = torch.randn(sum(q_lens), heads, dim, generator=gen)
    meta = AttentionMetadata.build(block_tables=tables, context_lens=[n - q for n, q in zip(lens, q_lens)],
                                   query_lens=q_lens, block_size=block)
    return query, k_cache, v_cache, meta, dim**-0.5
