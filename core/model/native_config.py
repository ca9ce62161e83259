"""Which checkpoints pagedkv's own Llama (``llama_model``) runs: a strict whitelist over ``config.json``.

transformers' model code costs seconds to import and to build: most of the start-up's floor. A
checkpoint whose ``config.json`` describes exactly what :mod:`pagedkv.core.model.llama_model` computes
loads without it; anything else, including any key this module does not know (it could change the
math), goes to transformers as before, and :func:`native_problem` says why in one phrase.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Keys that do not change what the forward computes (ids, bookkeeping, training-only settings).
_INERT_KEYS = frozenset({
    "_name_or_path", "_model_name_or_path", "architectures", "model_type", "transformers_version", "dtype",
    "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id",
    "initializer_range", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "max_position_embeddings", "attention_dropout", "tie_word_embeddings", "id2label", "label2id",
})
# Keys the module implements, with transformers' LlamaConfig default where the file may leave one out.
_MATH_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
    "rope_theta": None, "rope_parameters": None, "rope_scaling": None,
}
_DEFAULT_THETA = 10_000.0


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None when the file is missing or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def native_problem(raw: dict[str, Any]) -> str | None:
    """Why pagedkv's Llama cannot run this ``config.json`` exactly as transformers would (None: it can)."""
    if raw.get("architectures") != ["LlamaForCausalLM"] or raw.get("model_type") != "llama":
        return f"architectures={raw.get('architectures')!r}, model_type={raw.get('model_type')!r}"
    unknown = sorted(k for k in raw if k not in _INERT_KEYS and k not in _MATH_DEFAULTS)
    if unknown:
        return f"config keys it does not implement: {unknown}"
    cfg = {**_MATH_DEFAULTS, **raw}
    if cfg["hidden_act"] != "silu":
        return f"hidden_act={cfg['hidden_act']!r}"
    for key in ("attention_bias", "mlp_bias"):
        if cfg[key] is not False:
            return f"{key}={cfg[key]!r}"
    if cfg["pretraining_tp"] not in (1, None):
        return f"pretraining_tp={cfg['pretraining_tp']!r}"
    rope = cfg["rope_parameters"] or cfg["rope_scaling"] or {}
    if raw.get("rope_parameters") and raw.get("rope_scaling"):
        return "both rope_parameters and rope_scaling"
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope {rope!r} (only the default rotary embedding is implemented)"
    if set(rope) - {"rope_type", "type", "rope_theta"}:
        return f"rope parameters {sorted(set(rope) - {'rope_type', 'type', 'rope_theta'})}"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            return f"{key}={cfg[key]!r}"
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"] or cfg["num_attention_heads"]
    if cfg["hidden_size"] % heads or heads % kv_heads:
        return f"hidden_size {cfg['hidden_size']}, {heads} heads, {kv_heads} KV heads do not divide"
    return None


def native_config(raw: dict[str, Any]) -> SimpleNamespace:
    """The config under transformers' attribute names (what the KV spec, the engine and the module read)."""
    cfg = {**_MATH_DEFAULTS, "max_position_embeddings": 2048, "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, **raw}
    rope = cfg.pop("rope_parameters") or cfg.pop("rope_scaling", None) or {}
    cfg.pop("rope_scaling", None)
    theta = rope.get("rope_theta", cfg.pop("rope_theta", None) or _DEFAULT_THETA)
    cfg["num_key_value_heads"] = cfg["num_key_value_heads"] or cfg["num_attention_heads"]
    cfg["head_dim"] = cfg["head_dim"] or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}
    cfg["torch_dtype"] = cfg.get("dtype") or cfg.get("torch_dtype")
    cfg["_attn_implementation"] = "pagedkv"
    return SimpleNamespace(**cfg)


class GenerationDefaults:
    """``generation_config.json`` without transformers: its ids as attributes, and ``to_diff_dict`` (what
    ``--generation-config auto`` reads), left to transformers' ``GenerationConfig`` when the file sets a
    sampling field, so the defaults it takes are exactly transformers'."""

    _SAMPLING = frozenset({"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens"})

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = dict(values)
        self.eos_token_id = values.get("eos_token_id")
        self.bos_token_id = values.get("bos_token_id")
        self.pad_token_id = values.get("pad_token_id")

    def to_diff_dict(self) -> dict[str, Any]:
        if self._SAMPLING & set(self._values):
            from transformers import GenerationConfig

            return GenerationConfig.from_dict(self._values).to_diff_dict()
        return dict(self._values)
