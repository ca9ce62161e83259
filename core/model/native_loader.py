"""Load a whitelisted Llama checkpoint into pagedkv's own module, reading safetensors directly.

The module is built on the meta device (no random initialisation of weights about to be
replaced), then every parameter is assigned the checkpoint's tensor of the same name (a view of
the file's memory map: :mod:`.safetensors_mmap`), cast to the engine's dtype as transformers casts
it. A checkpoint with a missing, extra or misshapen tensor is refused (:class:`NativeLoadError`), and
the caller falls back to transformers.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from pagedkv.core.model.llama_model import LlamaForCausalLM
from pagedkv.core.model.native_config import GenerationDefaults, native_config, native_problem, read_json

log = logging.getLogger("pagedkv.model")


class NativeLoadError(Exception):
    """The checkpoint cannot be read into pagedkv's module (the message says why)."""


def native_reason(path: Path) -> str | None:
    """Why ``path`` cannot take pagedkv's own module (None: it can)."""
    raw = read_json(path / "config.json")
    if raw is None:
        return "config.json is missing or not a JSON object"
    problem = native_problem(raw)
    if problem is None and not _shards(path):
        return "no model.safetensors (or model.safetensors.index.json) in the directory"
    return problem


def _shards(path: Path) -> list[Path]:
    index = read_json(path / "model.safetensors.index.json")
    if index is not None and isinstance(index.get("weight_map"), dict):
        return [path / name for name in sorted(set(index["weight_map"].values()))]
    single = path / "model.safetensors"
    return [single] if single.is_file() else []


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from pagedkv.core.model.safetensors_mmap import read_safetensors

    tensors: dict[str, torch.Tensor] = {}
    for shard in _shards(path):
        tensors.update(read_safetensors(shard))
    return tensors


def load_native_llama(path: Path, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    """pagedkv's Llama for the checkpoint in ``path``, on ``device`` in ``dtype``, in eval mode."""
    config = native_config(read_json(path / "config.json") or {})
    config._name_or_path = str(path)  # as transformers sets it (telemetry names the model by it)
    generation = read_json(path / "generation_config.json")
    with torch.device("meta"):
        model = LlamaForCausalLM(config, GenerationDefaults(generation) if generation is not None else None)
    tensors = _read_tensors(path)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # transformers ties it to the embeddings whatever the file holds
    wanted = dict(model.named_parameters())
    missing = sorted(set(wanted) - set(tensors))
    extra = sorted(set(tensors) - set(wanted))
    if missing or extra:
        raise NativeLoadError(f"tensors missing {missing[:3]} / unexpected {extra[:3]}")
    state = {}
    for name, param in wanted.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise NativeLoadError(f"{name} has shape {tuple(tensor.shape)}, the config says {tuple(param.shape)}")
        state[name] = tensor.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = model.inv_freq.to(device)
    return model.eval()


def try_native(path: Path, dtype: torch.dtype, device: str) -> Any:
    """pagedkv's module for ``path``, or None (one debug line saying why) when transformers must load it."""
    reason = native_reason(path)
    if reason is None:
        try:
            return load_native_llama(path, dtype, device)
        except (NativeLoadError, OSError, ValueError) as exc:
            reason = str(exc)
    log.debug("pagedkv: loading %s with transformers, not pagedkv's own model: %s", path, reason)
    return None
