"""Workloads for ``engine simulate``: built-in length distributions, JSONL request files, recorded traces.

A workload is a list of :class:`SimRequest` (arrival, prompt length or token ids,
output length). Nothing here touches the engine; :mod:`pagedkv.sim.simulate`
feeds the requests to it.

Built-in distributions (seeded, ``random.Random``): lengths are lognormal with
the *published mean* of each dataset and a spread chosen by hand (sigma), so
``mu = ln(mean) - sigma**2 / 2`` and the sample mean matches the dataset's
mean; values are rounded and clipped to ``[1, max]``. They are not fitted to
the datasets' full histograms (those are not shipped here).

- ``sharegpt``: input mean 161.31 (sigma 1.0), output mean 337.99 (sigma 0.9),
  clipped to 4096 each: long chat answers, heavy tail;
- ``alpaca``: input mean 19.31 (sigma 0.6), output mean 58.45 (sigma 0.8),
  clipped to 1024: short instructions;
- ``shared-prefix``: one 512-token system prompt shared by every request, then a
  user part with mean 64 (sigma 0.8) and an output with mean 128 (sigma 0.8):
  what prefix caching is for.

Arrivals: all at time 0 by default (an offline batch), or a Poisson process with
``request_rate`` requests per second.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.core.errors import PagedKVError
from pagedkv.core.limits import check_cap


class WorkloadError(PagedKVError, ValueError):
    """A workload cannot be read or built; the message names the file and line or the setting."""


@dataclass
class SimRequest:
    prompt_len: int
    output_len: int
    arrival: float = 0.0  # seconds of simulated time
    prompt_token_ids: list[int] | None = None  # given ids (prefix caching sees them); else synthesized
    request_id: str | None = None
    n: int = 1
    shared_prefix_len: int = 0  # synthesized prompts: this many leading tokens are the shared system prompt
    arrival_step: int | None = None  # from a trace: add before this engine step (0-based), for exact replay
    source: str = ""  # where it came from, for error messages ("file.jsonl line 3", "sharegpt #17")


@dataclass
class Workload:
    name: str
    requests: list[SimRequest] = field(default_factory=list)
    clock: str = "time"  # "time": arrivals by simulated seconds; "step": by recorded engine step (traces)
    notes: list[str] = field(default_factory=list)

    @property
    def mean_prompt_len(self) -> float:
        return sum(r.prompt_len for r in self.requests) / max(1, len(self.requests))

    @property
    def mean_output_len(self) -> float:
        return sum(r.output_len for r in self.requests) / max(1, len(self.requests))


@dataclass(frozen=True)
class LengthDist:
    mean: float
    sigma: float
    maximum: int

    def sample(self, rng: random.Random) -> int:
        mu = math.log(self.mean) - self.sigma**2 / 2
        return max(1, min(self.maximum, round(rng.lognormvariate(mu, self.sigma))))


BUILTIN = {
    "sharegpt": (LengthDist(161.31, 1.0, 4096), LengthDist(337.99, 0.9, 4096), 0),
    "alpaca": (LengthDist(19.31, 0.6, 1024), LengthDist(58.45, 0.8, 1024), 0),
    "shared-prefix": (LengthDist(64.0, 0.8, 2048), LengthDist(128.0, 0.8, 2048), 512),
}


def builtin_workload(
    name: str, num_requests: int, *, seed: int = 0, request_rate: float | None = None
) -> Workload:
    """``num_requests`` requests of a built-in distribution; Poisson arrivals when ``request_rate`` is given."""
    if name not in BUILTIN:
        raise WorkloadError(
            f"unknown workload {name!r}; built-ins are {', '.join(BUILTIN)}, or give a .jsonl/trace file"
        )
    if num_requests < 1:
        raise WorkloadError(f"--num-requests must be at least 1, got {num_requests}")
    check_cap("requests", num_requests, "--num-requests", WorkloadError)
    if request_rate is not None and not (request_rate > 0 and math.isfinite(request_rate)):
        raise WorkloadError(f"--request-rate must be a positive number of requests per second, got {request_rate}")
    rng = random.Random(seed)
    prompt_dist, output_dist, prefix = BUILTIN[name]
    requests, t = [], 0.0
    for i in range(num_requests):
        if request_rate is not None:
            t += rng.expovariate(request_rate)
        user = prompt_dist.sample(rng)
        requests.append(
            SimRequest(prefix + user, output_dist.sample(rng), t, shared_prefix_len=prefix, source=f"{name} #{i}")
        )
    wl = Workload(name, requests)
    wl.notes.append(
        f"{name}: lognormal lengths with the dataset's mean (prompt {prompt_dist.mean}, output {output_dist.mean}), "
        f"sigma {prompt_dist.sigma}/{output_dist.sigma} by hand, seed {seed}"
        + (f", {prefix}-token shared system prompt" if prefix else "")
        + (f", Poisson arrivals at {request_rate}/s" if request_rate else ", all arriving at t=0")
    )
    return wl


# --- JSONL request files ---------------------------------------------------------------------------------------

_KEYS = {"arrival", "arrival_time", "prompt_len", "prompt_token_ids", "output_len", "id", "n"}


def _int_field(obj: dict, key: str, where: str, minimum: int) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise WorkloadError(f"{where}: {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def load_jsonl(path: str | Path) -> Workload:
    """One JSON object per line: ``{"arrival": 0.5, "prompt_len": 120, "output_len": 300}``.

    ``arrival`` (or ``arrival_time``): seconds, default 0. One of ``prompt_len`` or
    ``prompt_token_ids`` (both: they must agree). ``output_len``: tokens to generate.
    Optional ``id`` and ``n``. Blank lines are skipped; anything else wrong names its line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{path}: cannot read the workload file: {exc}") from None
    requests = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:
            raise WorkloadError(f"{where}: the JSON is nested too deeply") from None
        except ValueError as exc:  # a number of more than 4300 digits
            raise WorkloadError(f"{where}: not valid JSON ({str(exc).split(';')[0]})") from None
        if not isinstance(obj, dict):
            raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - _KEYS)
        if unknown:
            raise WorkloadError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}")
        arrival = obj.get("arrival", obj.get("arrival_time", 0.0))
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not (0 <= arrival < math.inf):
            raise WorkloadError(f"{where}: 'arrival' must be a number of seconds >= 0, got {arrival!r}")
        ids = obj.get("prompt_token_ids")
        if ids is not None:
            if not isinstance(ids, list) or not ids or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids
            ):
                raise WorkloadError(f"{where}: 'prompt_token_ids' must be a non-empty list of integers >= 0")
        if "prompt_len" in obj:
            prompt_len = _int_field(obj, "prompt_len", where, 1)
            if ids is not None and len(ids) != prompt_len:
                raise WorkloadError(f"{where}: prompt_len {prompt_len} but {len(ids)} prompt_token_ids")
        elif ids is not None:
            prompt_len = len(ids)
        else:
            raise WorkloadError(f"{where}: give 'prompt_len' or 'prompt_token_ids'")
        if "output_len" not in obj:
            raise WorkloadError(f"{where}: 'output_len' is missing")
        output_len = _int_field(obj, "output_len", where, 1)
        n = _int_field(obj, "n", where, 1) if "n" in obj else 1
        rid = obj.get("id")
        check_cap("requests", len(requests) + 1, f"{path}: the number of requests", WorkloadError)
        requests.append(
            SimRequest(prompt_len, output_len, float(arrival), ids, None if rid is None else str(rid), n, source=where)
        )
    if not requests:
        raise WorkloadError(f"{path}: the workload file has no requests")
    ids_seen: set[str] = set()
    for req in requests:
        if req.request_id is not None:
            if req.request_id in ids_seen:
                raise WorkloadError(f"{req.source}: request id {req.request_id!r} is used twice")
            ids_seen.add(req.request_id)
    return Workload(path.name, requests, notes=[f"{path}: {len(requests)} requests from JSONL"])


# --- traces recorded by `engine run --trace` -----------------------------------------------------------------


def load_trace(path: str | Path) -> Workload:
    """The requests of a recorded run: prompt lengths from ``request_add``, output lengths from the
    per-step ``progress`` and ``request_finish`` events, arrivals as the engine step they joined before.

    Token ids are not in a trace, so prompts are synthesized (prefix-cache hits are not reproduced).
    """
    from pagedkv.core.trace import TraceError, read_trace

    try:
        trace = read_trace(path)
    except TraceError as exc:
        raise WorkloadError(str(exc)) from None
    added: dict[str, SimRequest] = {}
    gen: dict[str, int] = {}
    out_len: dict[str, int] = {}
    step = 0
    prev_t = 0.0
    for msg, lineno in zip(trace.messages, trace.lines):
        if msg.get("type") != "delta":
            prev_t = float(msg.get("t", prev_t) or prev_t)
            continue
        where = f"{path} line {lineno}"
        for item in msg.get("events", []):
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict)):
                raise WorkloadError(f"{where}: an event must be a [kind, data] pair, got {item!r}")
            kind, data = item
            if kind == "request_add":
                rid = str(data.get("request"))
                prompt = data.get("prompt_tokens")
                if not isinstance(prompt, int) or prompt < 1:
                    raise WorkloadError(f"{where}: request_add of {rid!r} has no valid prompt_tokens")
                check_cap("requests", len(added) + 1, f"{path}: the number of requests", WorkloadError)
                added[rid] = SimRequest(
                    prompt, 1, prev_t, None, rid, int(data.get("n", 1) or 1), arrival_step=step, source=where
                )
            elif kind == "request_finish":
                rid = str(data.get("request"))
                extra = 0 if data.get("reason") == "abort" else 1  # the finishing step samples one more token
                out_len[rid] = max(out_len.get(rid, 0), gen.get(rid, 0) + extra)
        for rid, pair in (msg.get("progress") or {}).items():
            if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int):
                gen[rid] = max(gen.get(rid, 0), pair[1])
        step += 1
        prev_t = float(msg.get("t", prev_t) or prev_t)
    if not added:
        raise WorkloadError(f"{path}: the trace has no request_add events, so no workload can be read from it")
    requests, unfinished = [], 0
    for rid, req in added.items():
        if rid not in out_len:
            unfinished += 1
            continue
        req.output_len = max(1, out_len[rid])
        requests.append(req)
    if not requests:
        raise WorkloadError(f"{path}: no request in the trace finished, so no output lengths are known")
    wl = Workload(Path(path).name, requests, clock="step")
    wl.notes.append(f"{path}: {len(requests)} requests from a trace (arrivals by engine step, prompts synthesized)")
    if unfinished:
        wl.notes.append(f"{unfinished} request(s) never finished in the trace and were left out")
    return wl


def is_trace(path: str | Path) -> bool:
    """A telemetry trace starts with a ``hello`` message."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline(1 << 16)
        msg = json.loads(first)
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(msg, dict) and msg.get("type") == "hello" and "v" in msg


def load_workload(
    spec: str, *, num_requests: int = 1000, seed: int = 0, request_rate: float | None = None
) -> Workload:
    """A built-in name, a JSONL file, or a trace file (told apart by its first line)."""
    if spec in BUILTIN:
        return builtin_workload(spec, num_requests, seed=seed, request_rate=request_rate)
    path = Path(spec)
    if not path.exists():
        raise WorkloadError(
            f"--workload {spec!r} is neither a built-in ({', '.join(BUILTIN)}) nor an existing file"
        )
    if is_trace(path):
        return load_trace(path)
    return load_jsonl(path)


def synth_prompt(req: SimRequest, index: int, vocab_size: int) -> list[int]:
    """Token ids for a request without given ids: unique per request after its shared prefix.

    The shared prefix is token 1 repeated; the first token after it encodes the request
    number (two tokens when the vocabulary is small), so no two requests' unique parts
    look alike to the prefix cache. The rest is token 0.
    """
    if req.prompt_token_ids is not None:
        return req.prompt_token_ids
    base = max(2, vocab_size - 2)
    tokens = [1] * req.shared_prefix_len
    tag = [2 + index % base, 2 + (index // base) % base]
    rest = req.prompt_len - req.shared_prefix_len
    tokens.extend(tag[:rest])
    tokens.extend([0] * (rest - len(tag[:rest])))
    return tokens


def describe(wl: Workload) -> dict[str, Any]:
    return {
        "name": wl.name,
        "requests": len(wl.requests),
        "mean_prompt_len": round(wl.mean_prompt_len, 2),
        "mean_output_len": round(wl.mean_output_len, 2),
        "clock": wl.clock,
        "notes": wl.notes,
    }
