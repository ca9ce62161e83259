"""A tiny random Llama written as a GGUF model directory (``config.json``, the byte tokenizer, ``model.gguf``) with
its linears and embeddings in one block format, as llama.cpp's converter writes them (``attn_q`` / ``attn_k`` rows
permuted for its rotary layout, norms in F32); and the same weights de-quantized to an fp32 safetensors checkpoint,
the model the quantized one must equal."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tiny_checkpoint import save_tiny

_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, index, module = name.split(".", 3)
        return f"blk.{index}.{_NAMES[module.rsplit('.', 1)[0]]}.weight"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's rotary row permutation of a q / k weight."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# The K-quants' fp16 super-block scales: (block bytes, offsets of d and dmin; None where the format has none).
# The ``gguf`` package can read K-quants but not write them, so a fixture's K-quant weights are random blocks
# whose scale fields hold small finite values (any other bytes are valid quants and sub-block scales).
_K_QUANTS = {"Q4_K": (144, 0, 2), "Q5_K": (176, 0, 2), "Q6_K": (210, 208, None)}


def _random_k_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, cols / 256 * block_bytes]`` uint8: random ``kind`` blocks with finite, small super-block scales."""
    size, d_at, dmin_at = _K_QUANTS[kind]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    for at, scale in ((d_at, 3e-4), (dmin_at, 2e-4)):
        if at is not None:
            values = (rng.uniform(0.5, 1.5, size=(blocks.shape[0], 1)) * scale).astype(np.float16)
            blocks[:, at : at + 2] = values.view(np.uint8)
    return blocks.reshape(rows, -1)


def _stored(kind: str, w: np.ndarray, seed: int) -> np.ndarray:
    import gguf

    if kind in _K_QUANTS:
        return _random_k_blocks(kind, *w.shape, np.random.default_rng(seed))
    return gguf.quants.quantize(np.ascontiguousarray(w), gguf.GGMLQuantizationType[kind])


def save_tiny_gguf(root: Path, qtype: str, other: dict[str, str] | None = None, seed: int = 0,
                   **overrides) -> tuple[Path, Path]:
    """``(gguf_dir, fp32_dir)``: a random tiny Llama in ``qtype`` blocks (``other`` maps tensor names of the GGUF file
    to another type, e.g. ``{"blk.0.ffn_up.weight": "Q5_0"}``; a K-quant there is random blocks, see
    :data:`_K_QUANTS`), and its fp32 de-quantization as safetensors."""
    import gguf
    from safetensors.torch import load_file, save_file

    fields = {"hidden_size": 64, "intermediate_size": 96, "tie_word_embeddings": True, "initializer_range": 0.3,
              **overrides}
    fp32_dir = save_tiny(root / f"fp32-{qtype}", seed=seed, **fields)
    gguf_dir = save_tiny(root / f"gguf-{qtype}", seed=seed, **fields)
    (gguf_dir / "model.safetensors").unlink()
    state = load_file(str(fp32_dir / "model.safetensors"))
    config = json.loads((fp32_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(gguf_dir / "model.gguf"), "llama")
    dequantized = {}
    for name, tensor in sorted(state.items()):
        w = tensor.float().numpy()
        kind = (other or {}).get(_gguf_name(name), "F32" if w.ndim == 1 else qtype)
        kind_enum = gguf.GGMLQuantizationType[kind]
        stored = _permute(w, heads) if "q_proj" in name else _permute(w, kv_heads) if "k_proj" in name else w
        data = _stored(kind, stored, seed + len(dequantized))
        writer.add_tensor(_gguf_name(name), data, raw_shape=data.shape if kind == "F32" else None,
                          raw_dtype=kind_enum)
        back = gguf.quants.dequantize(data, kind_enum).reshape(w.shape)
        if "q_proj" in name or "k_proj" in name:  # undo the permutation: the fp32 model's own row order
            h = heads if "q_proj" in name else kv_heads
            back = back.reshape(h, back.shape[0] // h // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        dequantized[name] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(dequantized, str(fp32_dir / "model.safetensors"), metadata={"format": "pt"})
    return gguf_dir, fp32_dir
