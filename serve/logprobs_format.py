"""The engine's per-token ``{token id: logprob}`` entries in OpenAI's two response shapes.

Completions use the legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs`` as
``{text: logprob}``, ``text_offset``); chat uses ``content: [{token, logprob, bytes, top_logprobs}]``.
Each engine entry holds the sampled token (first) plus the ``k`` most likely ones, so the top list is
that entry sorted, cut to ``k``. Plain Python: the batch-file runner uses it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

LOWEST_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


class TokenTexts:
    """Each token id's own text and raw bytes, cached (a byte-level BPE token can be part of one character:
    its text is then U+FFFD, while ``bytes`` holds the real bytes, as OpenAI's do)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token: int) -> tuple[str, list[int]]:
        if token not in self._cache:
            if self.tokenizer is None:
                text = f"token_id:{token}"
                self._cache[token] = (text, list(text.encode()))
            else:
                text = self.tokenizer.decode([token])
                self._cache[token] = (text, self._bytes(token, text))
        return self._cache[token]

    def _bytes(self, token: int, text: str) -> list[int]:
        if "\ufffd" in text:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            table = _unicode_to_byte()
            if isinstance(piece, str) and piece and all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
        return list(text.encode("utf-8"))


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def _value(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, float] | None], k: int,
                        texts: TokenTexts, offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``offset`` is where the first token's text starts.

    An entry of None (an echoed prompt's first token: nothing predicts it) is ``null`` in both lists."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token, entry in zip(token_ids, entries):
        text = texts.get(token)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_value(entry[token]))
        top: dict[str, float] = {}
        for t, v in _top(entry, k):  # two ids with one text (two partial characters): the likelier one stays
            top.setdefault(texts.get(t)[0], _value(v))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, float]], k: int,
                  texts: TokenTexts) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [...]}``, one item per token."""
    content = []
    for token, entry in zip(token_ids, entries):
        text, raw = texts.get(token)
        top = []
        for t, v in _top(entry, k):
            t_text, t_raw = texts.get(t)
            top.append({"token": t_text, "logprob": _value(v), "bytes": t_raw})
        content.append({"token": text, "logprob": _value(entry[token]), "bytes": raw, "top_logprobs": top})
    return {"content": content}


def prompt_logprobs_json(entries: Sequence[dict[int, float] | None] | None,
                         texts: TokenTexts) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{id: {logprob, rank, decoded_token}}``;
    ``rank`` is 1-based in the vocabulary (left out for an entry that does not know its ranks)."""
    if entries is None:
        return None
    result: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        ranks = getattr(entry, "ranks", {})
        result.append({str(t): {"logprob": _value(v), **({"rank": ranks[t]} if t in ranks else {}),
                                "decoded_token": texts.get(t)[0]} for t, v in entry.items()})
    return result


_BYTE_TABLE: dict[str, int] = {}


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2 byte-level BPE spells each byte as one printable character; this maps them back."""
    if not _BYTE_TABLE:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        extra = 0
        for byte in range(256):
            if byte in printable:
                _BYTE_TABLE[chr(byte)] = byte
            else:
                _BYTE_TABLE[chr(256 + extra)] = byte
                extra += 1
    return _BYTE_TABLE
