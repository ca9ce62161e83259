"""A tiny random transformers Llama saved to a directory, as a checkpoint on disk is (tests in any folder)."""

from __future__ import annotations

import torch

BLOCK = 4
VOCAB = 261  # the byte tokenizer's 257 ids and a few more


def save_tiny(path, dtype=torch.float32, seed=0, **overrides):
    """A random transformers Llama saved with ``save_pretrained`` (plus the byte tokenizer); returns ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedkv.testing import byte_tokenizer

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=None, eos_token_id=None, pad_token_id=0)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**fields))
    with torch.no_grad():  # norms away from 1, so a missing or misplaced weight shows
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.uniform_(0.5, 1.5)
    model.to(dtype).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path
