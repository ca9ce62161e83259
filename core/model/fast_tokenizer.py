"""A tokenizer on ``tokenizers`` + ``jinja2`` alone: what start-up and the hot paths call, without transformers.

``from transformers import AutoTokenizer`` costs seconds at start-up. For a checkpoint whose
``tokenizer_config.json`` is a plain ``tokenizers`` backend (:data:`_PLAIN_KEYS`, nothing else), this
class answers natively what pagedkv calls: ``__call__(...)["input_ids"]``, ``decode``,
``convert_ids_to_tokens``, ``get_vocab``, ``eos_token_id``, ``chat_template`` and
``apply_chat_template`` (rendered as transformers renders it: see :mod:`.chat_render`). Anything else
(another argument, a rarer method) loads transformers' tokenizer once,
lazily, and is delegated to it, so rare paths keep working exactly as before.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

from pagedkv.core.model.native_config import read_json

# tokenizer_config.json keys that change nothing a plain ``tokenizers`` backend computes in transformers.
_PLAIN_KEYS = frozenset({
    "backend", "tokenizer_class", "bos_token", "eos_token", "unk_token", "pad_token", "is_local",
    "local_files_only", "model_max_length", "clean_up_tokenization_spaces", "chat_template",
})
_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def fast_tokenizer_problem(path: Path) -> str | None:
    """Why ``path``'s tokenizer needs transformers' class (None: :class:`FastTokenizer` is exact for it)."""
    config = read_json(path / "tokenizer_config.json")
    if config is None or not (path / "tokenizer.json").is_file():
        return "no tokenizer.json / tokenizer_config.json"
    if config.get("tokenizer_class") not in _CLASSES:
        return f"tokenizer_class {config.get('tokenizer_class')!r}"
    unknown = sorted(set(config) - _PLAIN_KEYS)
    if unknown:
        return f"tokenizer_config keys {unknown}"
    if config.get("clean_up_tokenization_spaces"):
        return "clean_up_tokenization_spaces=True"
    if any(not isinstance(config.get(k), (str, type(None))) for k in _SPECIAL_NAMES):
        return "special tokens given as objects"
    if not isinstance(config.get("chat_template"), (str, type(None))):
        return "a chat_template that is not one string (named templates)"
    return None


class FastTokenizer:
    """Transformers' ``TokenizersBackend`` behaviour for a plain checkpoint, natively where pagedkv needs it."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        config = read_json(path / "tokenizer_config.json") or {}
        self.name_or_path = str(path)
        self._backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.special_tokens_map = {k: config[k] for k in _SPECIAL_NAMES if config.get(k) is not None}
        for name in _SPECIAL_NAMES:
            setattr(self, name, config.get(name))
        template = path / "chat_template.jinja"
        self.chat_template = template.read_text(encoding="utf-8") if template.is_file() else config.get(
            "chat_template")
        self._hf: Any = None
        self._hf_lock = threading.Lock()

    @property
    def eos_token_id(self) -> int | None:
        return self._backend.token_to_id(self.eos_token) if self.eos_token is not None else None

    @property
    def bos_token_id(self) -> int | None:
        return self._backend.token_to_id(self.bos_token) if self.bos_token is not None else None

    @property
    def pad_token_id(self) -> int | None:
        return self._backend.token_to_id(self.pad_token) if self.pad_token is not None else None

    @property
    def all_special_ids(self) -> list[int]:
        """The named special tokens' ids, as transformers lists them (the config names no extra ones)."""
        tokens = dict.fromkeys(self.special_tokens_map[k] for k in _SPECIAL_NAMES if k in self.special_tokens_map)
        return [i for i in map(self._backend.token_to_id, tokens) if i is not None]

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        if kwargs or not isinstance(text, str):
            return self.transformers_tokenizer(text, add_special_tokens=add_special_tokens, **kwargs)
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> str:
        """As transformers 5: the backend's decode (``spaces_between_special_tokens`` changes nothing there)."""
        kwargs.pop("spaces_between_special_tokens", None)
        if kwargs or clean_up_tokenization_spaces:
            return self.transformers_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                                      clean_up_tokenization_spaces=clean_up_tokenization_spaces,
                                                      **kwargs)
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | list[str]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def tokenizers_json(self) -> str:
        """The ``tokenizers`` backend as JSON, padding and truncation off: what a grammar backend builds its own
        tokenizer from (llguidance reads transformers' tokenizer the same way, but importing transformers for it
        costs ~120 MiB of RSS and seconds)."""
        backend = copy.copy(self._backend)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, conversation: Any, tools: Any = None, *, tokenize: bool = True,
                            add_generation_prompt: bool = False, **kwargs: Any) -> Any:
        from pagedkv.core.model.chat_render import render_chat

        template = kwargs.pop("chat_template", None) or self.chat_template
        text = None
        if template is not None and not tokenize:
            text = render_chat(template, conversation, tools, add_generation_prompt,
                               {**self.special_tokens_map, **kwargs})
        if text is None:  # something only transformers' renderer handles (or tokenize=True): let it decide
            if template is not None:
                kwargs["chat_template"] = template
            return self.transformers_tokenizer.apply_chat_template(
                conversation, tools=tools, tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kwargs)
        return text

    @property
    def transformers_tokenizer(self) -> Any:
        """transformers' own tokenizer for the same files (loaded once, on first need)."""
        with self._hf_lock:
            if self._hf is None:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(self.name_or_path)
            self._hf.chat_template = self.chat_template
            return self._hf

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_backend", "_hf", "_hf_lock"):
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer, name)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_hf"] = None  # copies load their own transformers tokenizer if they ever need one
        del state["_hf_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._hf_lock = threading.Lock()

