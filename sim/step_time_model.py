"""How long one engine step would take on real hardware: a linear model of the step's shape.

``seconds = fixed + prefill_tokens * prefill_per_token + decode_seqs * decode_per_seq
+ context_tokens * per_context_token``, where ``context_tokens`` is the KV read by the
step's decodes. ``engine simulate`` advances its clock by this, which is what turns
block counts into queueing delay, time-to-first-token and throughput estimates.

The defaults are a roofline guess, not a measurement: an H100-SXM-like GPU
(3.35 TB/s HBM, 400 TFLOP/s dense bf16 reached) and the simulated model's size:
every step reads the weights once (``fixed`` = weights / bandwidth + 1 ms of
launch/scheduling overhead), a prompt token costs ``2 * params`` flops, a decode
sequence ``2 * params`` flops, and each cached token a decode attends to is read
once (its K/V bytes / bandwidth). Give measured numbers with ``--step-time`` or fit
them from a recorded run with ``--calibrate TRACE`` (least squares over its steps).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pagedkv.core.errors import ConfigError

HBM_BYTES_PER_S = 3.35e12
FLOPS = 400e12
OVERHEAD_S = 1e-3

_UNITS = {  # --step-time key -> (field, scale to seconds)
    "fixed_ms": ("fixed", 1e-3),
    "prefill_us_per_token": ("prefill_per_token", 1e-6),
    "decode_us_per_seq": ("decode_per_seq", 1e-6),
    "context_ns_per_token": ("per_context_token", 1e-9),
}


@dataclass
class StepTimeModel:
    fixed: float  # seconds per step
    prefill_per_token: float
    decode_per_seq: float
    per_context_token: float = 0.0
    source: str = "given"

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        return (
            self.fixed
            + prefill_tokens * self.prefill_per_token
            + decode_seqs * self.decode_per_seq
            + context_tokens * self.per_context_token
        )

    @classmethod
    def roofline(cls, num_params: float, weight_bytes: float, kv_bytes_per_token: float) -> StepTimeModel:
        return cls(
            fixed=weight_bytes / HBM_BYTES_PER_S + OVERHEAD_S,
            prefill_per_token=2 * num_params / FLOPS,
            decode_per_seq=2 * num_params / FLOPS,
            per_context_token=kv_bytes_per_token / HBM_BYTES_PER_S,
            source="roofline defaults (H100-like: 3.35 TB/s, 400 TFLOP/s, 1 ms overhead), not measured",
        )

    def with_overrides(self, text: str) -> StepTimeModel:
        """``"fixed_ms=8,decode_us_per_seq=30"``: any of the four keys, the rest kept."""
        values = asdict(self)
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            if not sep or key.strip() not in _UNITS:
                raise ConfigError(f"--step-time: cannot read {part!r}; use keys {', '.join(_UNITS)} as key=number")
            try:
                number = float(raw)
            except ValueError:
                raise ConfigError(f"--step-time: {key.strip()} must be a number, got {raw!r}") from None
            if number < 0:
                raise ConfigError(f"--step-time: {key.strip()} must be >= 0, got {number}")
            name, scale = _UNITS[key.strip()]
            values[name] = number * scale
        given = self.source.startswith("roofline")
        values["source"] = "given (--step-time)" if given else self.source + " + --step-time"
        return StepTimeModel(**values)

    def describe(self) -> dict[str, Any]:
        return {
            "fixed_ms": round(self.fixed * 1e3, 4),
            "prefill_us_per_token": round(self.prefill_per_token * 1e6, 4),
            "decode_us_per_seq": round(self.decode_per_seq * 1e6, 4),
            "context_ns_per_token": round(self.per_context_token * 1e9, 4),
            "source": self.source,
        }


def calibrate_from_trace(path: str) -> StepTimeModel:
    """Least-squares fit of the four coefficients to a recorded run's measured ``step_ms``.

    Per step, prefill tokens and decode sequences come from its ``request_schedule``
    events (1 token and past the prompt: a decode), context tokens from the previous
    ``progress``. Coefficients are clipped at 0. The first step (warm-up) is dropped.
    """
    import numpy as np

    from pagedkv.core.trace import TraceError, read_trace
    from pagedkv.sim.workload import WorkloadError

    try:
        trace = read_trace(path)
    except TraceError as exc:
        raise WorkloadError(str(exc)) from None
    prompt: dict[str, int] = {}
    computed: dict[str, int] = {}
    rows, times = [], []
    for msg in trace.messages:
        if msg.get("type") != "delta":
            continue
        prefill = decodes = context = 0
        for kind, data in msg.get("events", []):
            if kind == "request_add":
                prompt[str(data.get("request"))] = int(data.get("prompt_tokens", 0))
            elif kind == "request_schedule":
                rid, tokens = str(data.get("request")), int(data.get("tokens", 0))
                done = computed.get(rid, 0)
                if tokens == 1 and done >= prompt.get(rid, 0):
                    decodes += 1
                    context += done
                else:
                    prefill += tokens
        computed = {rid: pair[0] for rid, pair in (msg.get("progress") or {}).items()}
        step_ms = (msg.get("stats") or {}).get("step_ms")
        if isinstance(step_ms, (int, float)) and (prefill or decodes):
            rows.append([1.0, prefill, decodes, context])
            times.append(step_ms / 1e3)
    if len(rows) < 6:
        raise ConfigError(f"--calibrate {path}: the trace has only {len(rows)} timed steps; record a longer run")
    a, b = np.array(rows[1:], dtype=float), np.array(times[1:], dtype=float)
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    coef = np.clip(coef, 0.0, None)
    return StepTimeModel(*map(float, coef), source=f"fitted to {len(b)} steps of {path}")
