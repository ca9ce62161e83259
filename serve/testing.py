"""Test helpers for the server: a small byte-level BPE tokenizer with a chat template, built offline.

A byte-level tokenizer trained on a little English splits every Korean character into
three byte tokens, which is what the incremental detokenizer must handle.
"""

from __future__ import annotations

from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "PagedAttention keeps the KV cache in fixed-size blocks, so many requests fit at once.",
    "Hello world! How are you today? I am fine, thank you. What is the weather like?",
    "user assistant system: tell me a story about a dragon who learned to serve tokens.",
]


def byte_level_tokenizer(vocab_size: int = 320, chat_template: bool = True) -> Any:
    """A ``PreTrainedTokenizerFast`` (GPT-2 style byte-level BPE), trained in memory on a few sentences.

    Special tokens: ``<|endoftext|>`` (0), ``<|im_start|>`` (1), ``<|im_end|>`` (2, the EOS).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_CORPUS * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
