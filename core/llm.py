"""The offline API in vLLM's shape: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.errors import RequestRejected
from pagedkv.core.prompt_inputs import is_single_prompt
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.sched.request_check import check_text
from pagedkv.core.sched.sequence import RequestOutput

if TYPE_CHECKING:  # type hints only (torch is imported by the engine already)
    import torch


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    Keyword arguments are :class:`EngineConfig` fields (``backend``,
    ``block_size``, ``kv_cache_memory``, ``num_blocks``, ``max_model_len``, ...);
    ``plugins`` are extra plugin objects for this engine, as for :class:`Engine`.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        hf_model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        plugins: tuple[object, ...] = (),
        **config: Any,
    ) -> None:
        self.engine = Engine(EngineConfig(model=model, **config), model=hf_model, tokenizer=tokenizer, plugins=plugins)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | list[str] | list[list[int]] | list[dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order.

        A prompt is text, token ids, or vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``.
        ``priority`` (vLLM's): one integer per prompt, lower first (needs ``scheduler="priority"``).
        Every prompt is checked before any runs, so a bad one raises
        :class:`~pagedkv.core.errors.RequestRejected` without doing work.
        """
        if is_single_prompt(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        engine = self.engine
        priorities = [engine.check_priority(p) for p in _priorities(priority, len(prompts))]
        for prompt, sp in zip(prompts, params_list):  # every request checked before any runs
            engine.encode_prompt(prompt, sp.truncate_prompt_tokens)
            checked = sp.checked_copy()
            checked.check_vocab(engine.vocab_size)
            if checked.structured is not None:  # (compiled once here; the requests below reuse it)
                engine.check_structured(checked.structured)
        ids = [engine.add_request(p, sp, priority=pr) for p, sp, pr in zip(prompts, params_list, priorities)]
        results: dict[str, RequestOutput] = {}
        progress = _progress(len(ids)) if use_tqdm else None
        while engine.has_unfinished():
            for output in engine.step(stream=False):
                results[output.request_id] = output
                if progress is not None:
                    progress.update(1)
        if progress is not None:
            progress.close()
        return [results[i] for i in ids]

    def chat(
        self, messages: list[dict[str, str]] | list[list[dict[str, str]]], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [apply_chat_template(self.tokenizer, conv) for conv in conversations]
        return self.generate(prompts, sampling_params)


def apply_chat_template(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt, ready for the assistant's answer (RequestRejected for a malformed message)."""
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestRejected(f"chat message {index} must be a dict with a 'role' string")
        if not isinstance(message.get("content"), str):
            raise RequestRejected(f"chat message {index} ({message['role']}) has no 'content' string")
        check_text(message["content"], f"chat message {index}'s content")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req")


def _priorities(priority: object, count: int) -> list[int]:
    """vLLM's ``priority`` argument: None (all 0) or one value per prompt (the engine checks each)."""
    if priority is None:
        return [0] * count
    if not isinstance(priority, (list, tuple)) or len(priority) != count:
        raise RequestRejected(f"priority must be a list of one integer per prompt ({count}), got {priority!r:.60}")
    return list(priority)
