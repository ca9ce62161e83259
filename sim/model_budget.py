"""A model's shape from its config, its parameter count, and the KV budget left on a GPU."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pagedkv.core.errors import ConfigError, PagedKVError

# SmolLM2-135M's shape: the default when no --model-config is given.
DEFAULT_MODEL = dict(
    model_type="llama", num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    hidden_size=576, intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
)
_GPT2_NAMES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_embd": "hidden_size",
               "n_positions": "max_position_embeddings", "n_inner": "intermediate_size"}
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}
# Bytes a weight of each ``--quantization`` (and GGUF block format) takes: a block's bytes over its 32 values
# (core/model/quant_formats.py; int8 runs as Q8_0, int4 as Q4_1). Norms stay in --dtype; they are noise here.
QUANT_BYTES = {"int8": 34 / 32, "int4": 20 / 32, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32}


class SimulationError(PagedKVError, ValueError):
    """The simulation cannot run as set up; the message names the setting or request."""


# --- the model's shape and the KV budget -------------------------------------------------------------------------


def load_model_config(path: str | Path | None) -> SimpleNamespace:
    """A model's shape from its HF ``config.json`` (a file or a directory holding one); SmolLM2-135M if None."""
    if path is None:
        return SimpleNamespace(**DEFAULT_MODEL)
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SimulationError(f"--model-config {path}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:
        reason = exc if isinstance(exc, ValueError) else "nested too deeply"
        raise SimulationError(f"--model-config {path}: not valid JSON ({reason})") from None
    if not isinstance(raw, dict):
        raise SimulationError(f"--model-config {path}: expected a JSON object")
    raw = dict(raw.get("text_config") or {}, **{k: v for k, v in raw.items() if k != "text_config"})
    for old, new in _GPT2_NAMES.items():
        if old in raw and new not in raw:
            raw[new] = raw[old]
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size") if not raw.get(k)]
    if missing:
        raise SimulationError(f"--model-config {path}: missing {', '.join(missing)}; is it a decoder LM config?")
    raw.setdefault("vocab_size", 32000)
    raw.setdefault("intermediate_size", 4 * raw["hidden_size"])
    raw.setdefault("tie_word_embeddings", False)
    return SimpleNamespace(**raw)


def estimate_params(cfg: Any) -> int:
    """Parameters of a Llama/Qwen/GPT-2-shaped decoder (embeddings, attention, MLP, norms; biases ignored)."""
    h, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    inter = getattr(cfg, "intermediate_size", None) or 4 * h
    gated = getattr(cfg, "model_type", "llama") != "gpt2"
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    mlp = (3 if gated else 2) * h * inter
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 1
    per_layer = attn + experts * mlp + 2 * h
    embed = vocab * h * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)
    return int(layers * per_layer + embed + h)


def dtype_bytes(dtype: str) -> int:
    try:
        return _DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ConfigError(f"--dtype {dtype!r}: use float32, bfloat16 or float16") from None


def weight_bytes_per_param(dtype: str, quantization: str | None = None) -> float:
    """Bytes one weight takes: its dtype's size, or its ``quantization``'s block bytes per value."""
    if quantization is None:
        return dtype_bytes(dtype)
    try:
        return QUANT_BYTES[quantization.lower()]
    except KeyError:
        raise SimulationError(f"--quantization {quantization!r}: use one of {', '.join(QUANT_BYTES)}") from None


def gpu_kv_budget(cfg: Any, gpu_memory: int, utilization: float, dtype: str, num_params: float | None = None,
                  quantization: str | None = None) -> dict:
    """KV bytes = gpu_memory * utilization - weights (params * bytes a weight: the dtype's, or the quantized
    blocks'). Activations are not subtracted."""
    if not 0.0 < utilization <= 1.0:
        raise SimulationError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    params = int(num_params) if num_params else estimate_params(cfg)
    per_param = weight_bytes_per_param(dtype, quantization)
    weights = int(params * per_param)
    usable = int(gpu_memory * utilization)
    kv = usable - weights
    if kv <= 0:
        raise SimulationError(
            f"the weights alone (~{params / 1e9:.2f}B params x {per_param:g} bytes = {format_gib(weights)}) "
            f"do not fit in --gpu-memory {format_gib(gpu_memory)} x --gpu-memory-utilization {utilization} = "
            f"{format_gib(usable)}; "
            "give more GPU memory, a higher utilization, or a smaller dtype (or --quantization)"
        )
    return {"gpu_memory": gpu_memory, "utilization": utilization, "params": params, "weight_bytes": weights,
            "bytes_per_param": per_param, "quantization": quantization, "kv_bytes": kv,
            "note": "KV = gpu_memory x utilization - params x bytes a weight; activations not subtracted"}


def format_gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
