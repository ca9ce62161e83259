"""``--generation-config``: sampling defaults from the model's ``generation_config.json``, as vLLM takes them.

vLLM's default (``auto``) and SGLang take temperature / top_p / top_k / min_p / repetition_penalty
(and ``max_new_tokens`` as the default ``max_tokens``) from the model's generation config when a
request leaves them unset; ``vllm`` uses none (OpenAI's defaults); a directory names another
``generation_config.json``. Only values the file sets differently from transformers' defaults count
(``to_diff_dict``), as in vLLM, so a file that spells out ``top_k: 50`` changes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedkv.core.errors import ConfigError

_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(choice: str, model: Any) -> dict[str, Any]:
    """Request-field name -> default, from ``model.generation_config`` (``auto``) or ``choice``'s directory."""
    if choice == "vllm":
        return {}
    if choice == "auto":
        config = getattr(model, "generation_config", None)
        values = config.to_diff_dict() if config is not None else {}
    else:
        path = Path(choice).expanduser()
        if not (path / "generation_config.json").is_file():
            raise ConfigError(f"--generation-config {choice}: no generation_config.json in that directory "
                              "(give auto, vllm, or a directory holding one)")
        from transformers import GenerationConfig

        values = GenerationConfig.from_pretrained(path).to_diff_dict()
    return {ours: values[theirs] for theirs, ours in _FIELDS.items() if values.get(theirs) is not None}


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file's contents, or the argument itself when it is a template (has ``{``)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" in value:
        return value
    raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template")
