"""Helpers for testing pagedkv plugins: a tiny random model and temporary plugin registration.

    from pagedkv import Engine, EngineConfig
    from pagedkv.testing import registered, tiny_llama

    engine = Engine(EngineConfig(device="cpu", num_blocks=64), model=tiny_llama())
    with registered(engine, MyObserver()) as observer:
        engine.add_request([1, 2, 3])
        while engine.has_unfinished():
            engine.step()
    assert observer.steps > 0

In a pytest fixture, yield inside the ``with`` block and the plugin is
unregistered at teardown::

    @pytest.fixture
    def observer(engine):
        with registered(engine, MyObserver()) as plugin:
            yield plugin

This module imports neither pytest nor transformers until a function needs them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["BYTE_VOCAB", "TINY_VOCAB", "byte_tokenizer", "registered", "tiny_engine", "tiny_llama"]

TINY_VOCAB = 211
BYTE_VOCAB = 264  # a tiny model's vocabulary for byte_tokenizer(): 256 bytes, EOS, and 7 unused (padding) ids

# A ChatML-like template in plain bytes that renders tools, assistant tool calls and tool results.
BYTE_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{% if m.content is string %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}"
    "{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}"
)

# Hooks the engine looks up once, at construction: a plugin registered afterwards is seen by
# them only if the engine already had an implementation of the same hook then (see registered()).
_BUILD_TIME_HOOKS = (
    "pagedkv_register_backends",
    "pagedkv_register_allocators",
    "pagedkv_register_schedulers",
    "pagedkv_configure",
)


def tiny_llama(seed: int = 0, **overrides: Any) -> Any:
    """A random 2-layer Llama (64 hidden, 4 heads, 2 KV heads, vocab 211, 512 positions), float32, eval mode.

    ``overrides`` go to ``transformers.LlamaConfig`` (e.g. ``num_hidden_layers=1``). The same
    ``seed`` gives the same weights. No tokenizer: feed the engine token ids in ``1..vocab_size-1``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**fields)).eval()


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer(thinking: bool = False) -> Any:
    """A fast Hugging Face tokenizer with one token per byte (ids 0..255) and ``<|eos|>`` (id 256), with a chat
    template that renders tools; pair it with ``tiny_llama(vocab_size=BYTE_VOCAB)``. Any text round-trips,
    and a grammar backend can constrain it byte by byte. Built in memory: nothing is downloaded.
    With ``thinking``, ``<think>`` and ``</think>`` are one token each (ids 257, 258), as in a reasoning
    model's vocabulary, so a test can bias the model towards ending its reasoning."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: b for b, char in _byte_chars().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|eos|>")
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    if thinking:
        tokenizer.add_tokens(["<think>", "</think>"])  # (not special: their text stays in the decoded answer)
    return tokenizer


def tiny_engine(*plugins: Any, model: Any = None, **config: Any) -> Any:
    """An :class:`~pagedkv.Engine` on CPU over :func:`tiny_llama` (or ``model``), with ``plugins`` registered
    from the start, so every hook of theirs is seen. ``config`` goes to ``EngineConfig``
    (defaults here: ``device="cpu"``, ``num_blocks=64``, ``block_size=8``)."""
    from pagedkv.core.config import EngineConfig
    from pagedkv.core.engine import Engine

    config = {"device": "cpu", "num_blocks": 64, "block_size": 8, **config}
    return Engine(EngineConfig(**config), model=model if model is not None else tiny_llama(), plugins=plugins)


@contextmanager
def registered(engine: Any, plugin: Any, name: str | None = None, *, started: bool = True) -> Iterator[Any]:
    """Register ``plugin`` on ``engine.pm`` for the ``with`` block; it is unregistered afterwards, even on error.

    With ``started`` (the default) the plugin's own ``pagedkv_engine_started(engine)`` is called
    on entry, since registering late it missed the engine's start.

    The engine decides at construction which hooks it calls at all; a plugin registered later is
    seen by hooks called every time (``pagedkv_report_stats``) and by hooks the engine already had an
    implementation of when it was built (``pagedkv_on_step_events`` only if telemetry was on, the
    decision hooks only if a built-in plugin was switched on for them). Registrar hooks and
    ``pagedkv_configure`` have run by then. For a plugin that needs the rest, build the engine with it:
    ``Engine(config, model=..., plugins=(plugin,))``, or :func:`tiny_engine`.
    """
    late = [hook for hook in _BUILD_TIME_HOOKS if callable(getattr(plugin, hook, None))]
    if late:
        what = getattr(plugin, "__name__", type(plugin).__name__)
        raise ValueError(
            f"{what} implements {', '.join(late)}, which run only while an engine is built; "
            "pass it as Engine(..., plugins=(plugin,)) instead of registering it later"
        )
    engine.pm.register(plugin, name=name)
    try:
        if started and callable(getattr(plugin, "pagedkv_engine_started", None)):
            plugin.pagedkv_engine_started(engine=engine)
        yield plugin
    finally:
        engine.pm.unregister(plugin)
