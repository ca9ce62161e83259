"""What a constrained request's output must match (vLLM's ``StructuredOutputsParams``): exactly one of a JSON
schema, any JSON object, a regular expression, a list of choices or a Lark grammar.

Plain data, checked on construction: the engine compiles it (``grammar_compiler``) with whichever grammar
backend the config names, so nothing here imports one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedkv.core.errors import RequestRejected

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint. ``json`` is a JSON schema (a dict, or its text); ``json_object`` asks for any JSON
    object; ``choice`` is a list of strings, one of which is the whole output. ``disable_any_whitespace``
    (vLLM's name; True here by default) keeps JSON compact, so a small model cannot spend its token
    budget on whitespace."""

    json: dict[str, Any] | str | bool | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True
    # a thinking model's markers as token ids: the grammar applies after ``reasoning_end`` (set by the server's
    # reasoning parser, not by clients; a later ``reasoning_start`` in the prompt reopens it). See reasoning_gate.
    reasoning_start: tuple[int, ...] = ()
    reasoning_end: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            what = ", ".join(given) if given else "none"
            raise RequestRejected(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {what}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as exc:
                raise RequestRejected(f"structured_outputs.json is not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise RequestRejected(f"structured_outputs.json must be a JSON schema object, got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestRejected(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice or not all(
                    isinstance(c, str) and c for c in choice):
                raise RequestRejected(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                      f"got {choice!r}")
            object.__setattr__(self, "choice", tuple(choice))
        for name in ("reasoning_start", "reasoning_end"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise RequestRejected(f"structured_outputs.{name} must be a tuple of token ids")
        if not isinstance(self.disable_any_whitespace, bool):
            raise RequestRejected("structured_outputs.disable_any_whitespace must be true or false")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> str:
        """A canonical text naming this constraint: equal constraints share one compiled grammar."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True, separators=(",", ":"))

    @classmethod
    def of(cls, value: Any) -> StructuredOutputs | None:
        """``SamplingParams.structured`` as given: None, an instance, or a dict of the same fields."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {*KINDS, "disable_any_whitespace"}
            if unknown:
                raise RequestRejected(f"structured_outputs has unknown field {sorted(unknown)[0]!r}")
            return cls(**value)
        raise RequestRejected(f"structured must be a StructuredOutputs or a dict, got {value!r}")
