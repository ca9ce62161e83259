"""A Llama GGUF file run as it is stored (``quantization="gguf"``): its ``Q8_0`` / ``Q4_0`` / ``Q4_1`` weights kept
as their blocks (:mod:`.quant_linear`), everything else de-quantized at load with a log line saying which.

The config and the tokenizer are taken from the file once by transformers (its GGUF readers map the metadata)
into a small directory under the cache (``<name>-<key>-gguf``: ``config.json``, ``generation_config.json``, the
tokenizer, and ``model.gguf``, a link to the file); no weights are written. The weights are read at every load
with the ``gguf`` package's reader, which hands out each tensor's raw bytes. llama.cpp's converter permutes the
rows of ``attn_q`` / ``attn_k`` for its rotary layout; they are permuted back here as transformers does (whole
rows, so the blocks move unchanged).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedkv.core.errors import ConfigError
from pagedkv.core.model.llama_model import LlamaForCausalLM
from pagedkv.core.model.native_config import GenerationDefaults, native_config, native_problem, read_json
from pagedkv.core.model.quant_formats import FORMATS
from pagedkv.core.model.quant_linear import QuantEmbedding, QuantLinear

log = logging.getLogger("pagedkv.model")

GGUF_LINK = "model.gguf"
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens", "output_norm.weight": "model.norm",
              "output.weight": "lm_head"}


class GGUFLlama(LlamaForCausalLM):
    """pagedkv's Llama with (some) weights in GGUF blocks: its dtype and device are those of its norms."""

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device


def gguf_sidecar(gguf_path: Path, directory: Path) -> Path:
    """``directory`` holding the file's config, generation config and tokenizer (written once) and a link to it."""
    if not (directory / "config.json").exists():
        _write_sidecar(gguf_path, directory)
    link = directory / GGUF_LINK
    if not (link.is_symlink() and link.resolve() == gguf_path.resolve()):  # the same file, installed elsewhere
        tmp = directory / f".{GGUF_LINK}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(gguf_path.resolve())
        os.replace(tmp, link)
    return directory


def _write_sidecar(gguf_path: Path, directory: Path) -> None:
    print(f"pagedkv: reading the config and tokenizer of {gguf_path.name} (once)...", file=sys.stderr)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; the user needs one message
        raise ConfigError(f"cannot read {gguf_path} as a GGUF model: {type(exc).__name__}: {exc}") from exc
    if config.model_type != "llama":
        raise ConfigError(f"quantization gguf runs Llama GGUF files; {gguf_path.name} is {config.model_type!r} "
                          "(leave --quantization unset to de-quantize it to float32)")
    config.architectures = ["LlamaForCausalLM"]
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=".reading-"))
    try:
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)  # atomic: a half-written directory is never picked up
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_problem(path: Path) -> str | None:
    """Why ``path`` is not a GGUF sidecar pagedkv's Llama runs (None: it is)."""
    raw = read_json(path / "config.json")
    if raw is None or not (path / GGUF_LINK).exists():
        return f"{path} has no config.json and {GGUF_LINK}"
    return native_problem(raw)


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q or k weight (rows of any width: floats or blocks)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def _target(name: str) -> str | None:
    """The module path (``model.layers.3.self_attn.q_proj``) a GGUF tensor name fills, None for an unknown one."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _LAYER.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def _float(data: np.ndarray, tensor: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """``data`` of a tensor of any GGUF type as fp32 (de-quantized by the ``gguf`` package unless it is a float)."""
    from gguf import GGMLQuantizationType, quants

    if tensor.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        log.info("pagedkv: %s is %s, not a format kept quantized (%s): de-quantized to float32 at load",
                 tensor.name, tensor.tensor_type.name, ", ".join(FORMATS))
        data = quants.dequantize(data, tensor.tensor_type)
    return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)


def _module_for(tensor: Any, target: str, config: Any, dtype: torch.dtype) -> nn.Module | torch.Tensor:
    """What fills ``target``: a quantized module, or a float tensor (a norm's or a de-quantized weight)."""
    qtype = tensor.tensor_type.name
    shape = tuple(int(x) for x in reversed(tensor.shape))  # GGUF lists the fastest dimension first
    data = np.asarray(tensor.data)
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    head_count = next((h for suffix, h in heads.items() if target.endswith(suffix)), None)
    if head_count is not None:
        data = _unpermute(data, head_count)
    if qtype in FORMATS and len(shape) == 2 and not target.endswith("norm"):
        blocks = torch.from_numpy(np.array(data, dtype=np.uint8))  # a copy: the reader's map is read-only
        if target == "model.embed_tokens":
            return QuantEmbedding(blocks, qtype, shape[1], dtype)
        return QuantLinear(blocks, qtype, shape[1], shape[0])
    return _float(data, tensor, shape).to(dtype)


def load_gguf_llama(path: Path, dtype: torch.dtype, device: str) -> GGUFLlama:
    """pagedkv's Llama over the GGUF file linked from the sidecar ``path``, in eval mode on ``device``."""
    from gguf import GGUFReader

    config = native_config(read_json(path / "config.json") or {})
    config._name_or_path = str(path)
    generation = read_json(path / "generation_config.json")
    with torch.device("meta"):
        model = GGUFLlama(config, GenerationDefaults(generation) if generation is not None else None)
    reader = GGUFReader(path / GGUF_LINK)
    filled: set[str] = set()
    for tensor in reader.tensors:
        target = _target(tensor.name)
        if target is None:
            raise ConfigError(f"{path / GGUF_LINK}: tensor {tensor.name!r} is not one pagedkv's Llama has")
        _fill(model, target, _module_for(tensor, target, config, dtype))
        filled.add(target)
    if "lm_head" not in filled:  # tied to the embeddings (no output.weight in the file)
        embed = model.model.embed_tokens
        model.lm_head = embed.as_linear() if isinstance(embed, QuantEmbedding) else _tied(embed)
        filled.add("lm_head")
    missing = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if missing:
        raise ConfigError(f"{path / GGUF_LINK} lacks tensors for {sorted(missing)[:3]}")
    model.inv_freq = model.inv_freq.to(device)
    return model.to(device).eval()


def _tied(embed: nn.Embedding) -> nn.Linear:
    with torch.device("meta"):
        head = nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False)
    head.weight = embed.weight
    return head


def _fill(model: nn.Module, target: str, value: nn.Module | torch.Tensor) -> None:
    parent_name, _, leaf = target.rpartition(".")
    parent = model.get_submodule(parent_name)
    if isinstance(value, nn.Module):
        setattr(parent, leaf, value)
        return
    module = getattr(parent, leaf)
    expected = tuple(module.weight.shape)
    if tuple(value.shape) != expected:
        raise ConfigError(f"GGUF tensor for {target} has shape {tuple(value.shape)}, the config says {expected}")
    module.weight = nn.Parameter(value, requires_grad=False)
