"""Megatron-style sharding of a Hugging Face decoder across tensor-parallel ranks.

Each rank keeps 1/N of every layer's attention heads, KV heads and MLP columns:
``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj`` are split by output rows
(column-parallel), ``o_proj``/``down_proj`` by input columns (row-parallel), and a
forward hook all-reduces the row-parallel outputs, so the rest of the model sees the
full hidden state. The model's own code is untouched: HF attention reshapes with
``-1`` heads, so a narrower projection simply means fewer heads. Embeddings, norms and
``lm_head`` stay replicated (simple, and cheap next to the layers on CPU).

Query head ``h`` reads KV head ``h // (H / Hkv)``; giving rank ``r`` the ``r``-th
contiguous slice of both keeps every query head with its KV head.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from pagedkv.core.errors import ConfigError
from pagedkv.core.kv.kv_cache import KVCacheSpec

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def check_divisible(hf_config: Any, world_size: int) -> None:
    """Raise a :class:`ConfigError` unless ``world_size`` splits the heads, KV heads and MLP evenly."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    sizes = {
        "attention heads": heads,
        "KV heads": kv_heads,
        "MLP width (intermediate_size)": getattr(hf_config, "intermediate_size", None) or 0,
    }
    for what, size in sizes.items():
        if size % world_size:
            raise ConfigError(
                f"tensor_parallel_size {world_size} does not divide the model's {size} {what}; "
                f"use a tensor_parallel_size that divides {kv_heads} (the KV heads) and {heads}"
            )


def rank_spec(spec: KVCacheSpec, world_size: int) -> KVCacheSpec:
    """The KV cache one rank holds: its share of the KV heads, the same blocks and block size."""
    return replace(spec, num_kv_heads=spec.num_kv_heads // world_size)


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a Llama-style model (``model.model.layers`` with q/k/v/o and gate/up/down)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(_has_projections(layer) for layer in layers):
        raise ConfigError(
            f"tensor parallelism needs a Llama-style decoder (q/k/v/o_proj and gate/up/down_proj in "
            f"model.model.layers); {type(model).__name__} has another layout"
        )
    return list(layers)


def _has_projections(layer: Any) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) and all(
        hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")
    )


def shard_model(model: Any, rank: int, world_size: int, all_reduce: Any) -> None:
    """Cut ``model`` in place down to rank ``rank``'s shard; ``all_reduce(tensor)`` sums over the ranks in place."""
    check_divisible(model.config, world_size)
    for layer in decoder_layers(model):
        for parent in (layer.self_attn, layer.mlp):
            for name in COLUMN_PARALLEL:
                if hasattr(parent, name):
                    _shard_columns(getattr(parent, name), rank, world_size)
            for name in ROW_PARALLEL:
                if hasattr(parent, name):
                    linear = getattr(parent, name)
                    _shard_rows(linear, rank, world_size)
                    linear.register_forward_hook(_make_reduce_hook(all_reduce))


def _slice(weight: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.nn.Parameter:
    size = weight.shape[dim] // world_size
    return torch.nn.Parameter(weight.narrow(dim, rank * size, size).clone(), requires_grad=False)


def _shard_columns(linear: torch.nn.Linear, rank: int, world_size: int) -> None:
    """Keep this rank's output features (and their bias)."""
    linear.weight = _slice(linear.weight.data, 0, rank, world_size)
    if linear.bias is not None:
        linear.bias = _slice(linear.bias.data, 0, rank, world_size)
    linear.out_features = linear.weight.shape[0]


def _shard_rows(linear: torch.nn.Linear, rank: int, world_size: int) -> None:
    """Keep this rank's input features; the bias is added once, by rank 0, so the sum counts it once."""
    linear.weight = _slice(linear.weight.data, 1, rank, world_size)
    if linear.bias is not None and rank != 0:
        linear.bias = None
    linear.in_features = linear.weight.shape[1]


def _make_reduce_hook(all_reduce: Any) -> Any:
    def reduce_output(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        all_reduce(output)
        return output

    return reduce_output
