"""What pagedkv can run, checked when a model is loaded: anything else is refused by name, never run wrongly.

The engine runs a decoder-only causal LM whose every layer calls the
transformers attention interface once, with keys and values of one shape (the
KV cache's), optionally with a sliding window (``sliding_window``) and score
softcapping (``softcap``), which the backends implement. Two checks:

- the config: features the engine does not implement (encoder-decoder,
  cross-attention, ALiBi, chunked or bidirectional attention, layer kinds
  other than full and sliding attention) are refused by name;
- a probe: one 2-token forward with a recording attention function shows what
  each layer really passes. A layer that never calls it (state-space or
  linear-attention layers), keys of another shape, an argument the engine does
  not understand (e.g. attention sinks), or a window / softcap the config
  describes but the layer is not told (so transformers' masks and ours would
  differ) is refused.

``final_logit_softcapping`` needs nothing: transformers applies it to the
logits inside the model's forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.core.errors import ConfigError

PROBE_NAME = "pagedkv_probe"
# Keyword arguments of the attention call that change nothing the engine computes (or that it implements).
HARMLESS_KWARGS = frozenset(
    {"dropout", "scaling", "sliding_window", "softcap", "use_cache", "position_ids", "cache_position",
     "output_attentions", "is_causal", "head_mask", "pagedkv_step"}
)
KNOWN_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends: full causal (``window=None``) or a sliding window, with or without softcapping."""

    window: int | None = None
    softcap: float | None = None


class UnsupportedModelError(ConfigError):
    """The model needs a feature pagedkv does not implement."""


def config_problems(config: Any) -> list[str]:
    """Features in ``config`` the engine does not implement, one phrase each (empty: none found)."""
    problems = []
    if getattr(config, "is_encoder_decoder", False):
        problems.append("an encoder-decoder architecture (is_encoder_decoder=True)")
    if getattr(config, "add_cross_attention", False):
        problems.append("cross-attention (add_cross_attention=True)")
    if getattr(config, "alibi", False) or getattr(config, "use_alibi", False) or (
        getattr(config, "position_embedding_type", None) == "alibi"
    ) or getattr(config, "model_type", None) in ("bloom", "mpt"):
        problems.append("ALiBi position biases")
    if getattr(config, "attention_chunk_size", None):
        problems.append(f"chunked attention (attention_chunk_size={config.attention_chunk_size})")
    if getattr(config, "use_bidirectional_attention", False):
        problems.append("bidirectional attention (use_bidirectional_attention=True)")
    layer_types = getattr(config, "layer_types", None) or []
    unknown = sorted(set(layer_types) - KNOWN_LAYER_TYPES)
    if unknown:
        problems.append(f"layer types {unknown} (only full and sliding attention are implemented)")
    window = getattr(config, "sliding_window", None)
    if window is not None and (not isinstance(window, int) or window < 1):
        problems.append(f"sliding_window={window!r} (must be a positive integer)")
    return problems


def expected_layers(config: Any) -> tuple[LayerAttention, ...]:
    """Each layer's window and softcap as the config describes them (how transformers builds its masks)."""
    window = getattr(config, "sliding_window", None)
    softcap = getattr(config, "attn_logit_softcapping", None)
    layer_types = getattr(config, "layer_types", None)
    layers = []
    for i in range(config.num_hidden_layers):
        sliding = layer_types[i] == "sliding_attention" if layer_types else window is not None
        layers.append(LayerAttention(window if sliding else None, softcap))
    return tuple(layers)


def check_model_support(model: Any) -> tuple[LayerAttention, ...]:
    """Refuse a model the engine would run wrongly (:class:`UnsupportedModelError`); else each layer's attention."""
    config = model.config
    name = getattr(config, "model_type", None) or type(model).__name__
    problems = config_problems(config)
    if getattr(model, "pagedkv_native", False) and not problems:  # pagedkv's Llama: whitelisted, tested exact
        return expected_layers(config)
    if not problems:
        expected = expected_layers(config)
        calls = _probe(model)
        problems = _call_problems(config, expected, calls)
    if problems:
        raise UnsupportedModelError(
            f"model type {name!r} uses " + "; ".join(problems)
            + ", which pagedkv does not implement (refusing rather than generating wrong tokens)"
        )
    return expected


def _call_problems(config: Any, expected: tuple[LayerAttention, ...], calls: list[dict[str, Any]]) -> list[str]:
    from pagedkv.core.kv.kv_cache import KVCacheSpec

    spec = KVCacheSpec.from_model_config(config, 1, torch.float32)
    by_layer: dict[int, list[dict[str, Any]]] = {}
    for call in calls:
        by_layer.setdefault(call["layer"], []).append(call)
    problems = []
    missing = [i for i in range(len(expected)) if i not in by_layer]
    if missing:
        problems.append(f"layers without standard attention {missing} (e.g. state-space or linear attention)")
    extra = sorted(str(i) for i, c in by_layer.items() if i is None or not 0 <= i < len(expected) or len(c) > 1)
    if extra:
        problems.append(f"attention calls that do not map one-to-one onto the layers (layer_idx {extra})")
    for layer, want in enumerate(expected):
        if len(by_layer.get(layer, ())) != 1:
            continue
        call = by_layer[layer][0]
        if call["key"] != (spec.num_kv_heads, spec.head_dim) or call["value"] != call["key"]:
            problems.append(
                f"layer {layer}: keys {call['key']} / values {call['value']} (heads, dim) unlike the KV cache's "
                f"{(spec.num_kv_heads, spec.head_dim)}"
            )
        unknown = sorted(k for k, v in call["kwargs"].items() if k not in HARMLESS_KWARGS and v is not None)
        if unknown:
            problems.append(f"layer {layer}: attention arguments {unknown}")
        if call["kwargs"].get("sliding_window") != want.window:
            problems.append(
                f"layer {layer}: a sliding window of {want.window} in its config but "
                f"{call['kwargs'].get('sliding_window')} passed to its attention"
            )
        if call["kwargs"].get("softcap") != want.softcap:
            problems.append(
                f"layer {layer}: attention softcapping of {want.softcap} in its config but "
                f"{call['kwargs'].get('softcap')} passed to its attention"
            )
        if float(call["kwargs"].get("dropout") or 0.0) != 0.0:
            problems.append(f"layer {layer}: attention dropout (the model is not in eval mode)")
    return problems[:4]


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch's intra-op threads at 1 for the block. A 2-token forward reads each weight once, which one thread
    does about as fast as several; on a busy machine several OpenMP threads wait on one another at every op
    (measured: 0.55 s with 1 thread, 4.5-10 s with 2, for SmolLM2-135M on 2 shared cores at load 9)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _probe(model: Any) -> list[dict[str, Any]]:
    """Run a 2-token forward with a recording attention function; what each layer passed."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    calls: list[dict[str, Any]] = []

    def record(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs: Any):
        calls.append({
            "layer": getattr(module, "layer_idx", None),
            "key": (key.shape[1], key.shape[-1]),
            "value": (value.shape[1], value.shape[-1]),
            "kwargs": kwargs,
        })
        return query.transpose(1, 2).contiguous(), None

    AttentionInterface.register(PROBE_NAME, record)
    AttentionMaskInterface.register(PROBE_NAME, lambda *args, **kwargs: None)
    previous = model.config._attn_implementation
    device = next(model.parameters()).device
    try:
        model.set_attn_implementation(PROBE_NAME)
        with torch.inference_mode(), _one_thread():
            model(
                input_ids=torch.zeros((1, 2), dtype=torch.long, device=device),
                position_ids=torch.arange(2, device=device)[None],
                use_cache=False,
            )
    except Exception as exc:  # noqa: BLE001 - any failure here means the model cannot run on pagedkv's attention
        raise UnsupportedModelError(
            f"model type {getattr(model.config, 'model_type', '?')!r} cannot run on a custom attention function "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    finally:
        try:
            model.set_attn_implementation(previous)
        except Exception:  # noqa: BLE001 - restoring is best effort; the runner sets its own implementation next
            pass
    return calls
