"""Checks of ``engine run``'s arguments that need no model, made before anything slow starts.

Each failure is a :class:`ConfigError` (one ``engine: error:`` line, exit 2).
"""

from __future__ import annotations

from typing import Any

from pagedkv.core.errors import ConfigError
from pagedkv.core.limits import check_cap, check_host_memory


def check_run_args(args: Any) -> None:
    """Refuse what can be refused from the arguments alone: counts, prompts, output paths, host memory."""
    if args.n < 1:
        raise ConfigError(f"--n must be at least 1, got {args.n}")
    check_cap("samples", args.n, "--n")
    for index, prompt in enumerate(args.prompt or (), start=1):
        check_utf8(prompt, f"--prompt #{index}")
    if getattr(args, "trace", None):
        from pagedkv.core.output_files import check_output_path

        check_output_path(args.trace, "--trace")
    if args.kv_cache_memory is not None and _on_cpu(args.device):
        from pagedkv.core.config import parse_bytes

        budget = parse_bytes(args.kv_cache_memory)
        if budget > 0:
            check_host_memory(budget, f"--kv-cache-memory {args.kv_cache_memory}")


def check_utf8(text: str, what: str) -> None:
    """Refuse text that is not valid Unicode (undecodable bytes arrive from argv as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        code = ord(bad)
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise ConfigError(f"{what} is not valid UTF-8 ({byte} at character {exc.start}); give UTF-8 text") from None


def _on_cpu(device: str) -> bool:
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return str(device).startswith("cpu")
