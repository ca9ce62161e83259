"""A request's output constraint -> one ``StructuredOutputs``, from any of the spellings clients send.

OpenAI's ``response_format`` (``json_object``, ``json_schema`` with ``strict``), vLLM's ``structured_outputs``
``{json, regex, choice, grammar, json_object}`` and its legacy ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``, declared on both generation endpoints (``StructuredFields``); a bad
value raises ``InvalidField`` naming the field. Two constraints in one request are refused, not merged.
JSON schemas come out closed to unlisted keys (``closed_schema``) unless the server allows them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pagedkv.core.errors import RequestRejected
from pagedkv.core.sample.structured_output import StructuredOutputs
from pagedkv.serve.api.closed_schema import closed_schema
from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.api.strict_body import StrictBody

LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
# vLLM sets no limit; each choice is a branch of the grammar compiled per request, so one is set
MAX_CHOICES = 2_000
FIELDS = ("response_format", "structured_outputs", *LEGACY, "guided_decoding_backend", "guided_whitespace_pattern")


class StructuredFields(StrictBody):
    """On completions and chat: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and ``guided_*``."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # auto or guidance only: the server's backend compiles
    guided_whitespace_pattern: str | None = None

    def structured(self, allow_additional_properties: bool = False) -> tuple[StructuredOutputs | None, str | None]:
        """(the constraint, the field naming it); raises ``InvalidField``."""
        return structured_from_body(self.model_dump(include=set(FIELDS)), allow_additional_properties)


def structured_from_body(body: Mapping[str, Any], allow_additional_properties: bool = False
                         ) -> tuple[StructuredOutputs | None, str | None]:
    """(the constraint, the field that gave it), or (None, None) when the body asks for none.
    ``allow_additional_properties``: leave JSON schemas as given (unlisted keys allowed where unset)."""
    found: list[tuple[StructuredOutputs, str]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        constraint = _response_format(response_format)
        if constraint is not None:
            found.append((constraint, "response_format"))
    if body.get("structured_outputs") is not None:
        found.append((_structured_outputs(body["structured_outputs"]), "structured_outputs"))
    for name, kind in LEGACY.items():
        if body.get(name) is not None:
            found.append((_make(name, {kind: body[name]}), name))
    if not allow_additional_properties:
        found = [(closed_constraint(constraint), field) for constraint, field in found]
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in ("auto", "guidance"):
        raise InvalidField("guided_decoding_backend", f"guided_decoding_backend {backend!r} is not available: this "
                         "server compiles grammars with its --structured-outputs-backend (guidance by default)")
    if body.get("guided_whitespace_pattern") is not None:
        raise InvalidField("guided_whitespace_pattern", "guided_whitespace_pattern is not supported by pagedkv "
                                                      "(use structured_outputs.disable_any_whitespace)")
    if len(found) > 1:
        raise InvalidField(found[1][1], f"{found[1][1]} cannot be combined with {found[0][1]}: give one constraint")
    return found[0] if found else (None, None)


def closed_constraint(constraint: StructuredOutputs) -> StructuredOutputs:
    """``constraint`` with its JSON schema closed to unlisted keys (any other kind as it is)."""
    if constraint.kind != "json":
        return constraint
    return dataclasses.replace(constraint, json=closed_schema(constraint.json))


def _response_format(value: Any) -> StructuredOutputs | None:
    if not isinstance(value, Mapping):
        raise InvalidField("response_format", f"response_format must be an object, got {value!r}")
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise InvalidField("response_format.json_schema", "response_format of type json_schema needs a "
                                                            "json_schema object with a schema")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            schema = {"type": "object"}  # OpenAI allows a name alone: any object
        if not isinstance(schema, (Mapping, bool)):
            raise InvalidField("response_format.json_schema.schema", "response_format.json_schema.schema must be a "
                                                                   "JSON schema object")
        if spec.get("strict") not in (None, True, False):
            raise InvalidField("response_format.json_schema.strict", "strict must be true or false")
        return _make("response_format.json_schema.schema", {"json": dict(schema) if isinstance(schema, Mapping)
                                                            else schema})
    raise InvalidField("response_format.type", f"response_format.type must be text, json_object or json_schema, "
                                             f"got {kind!r}")


def _structured_outputs(value: Any) -> StructuredOutputs:
    if not isinstance(value, Mapping):
        raise InvalidField("structured_outputs", f"structured_outputs must be an object, got {value!r}")
    unknown = sorted(set(value) - set(STRUCTURED_KEYS))
    if unknown:
        raise InvalidField(f"structured_outputs.{unknown[0]}", f"structured_outputs.{unknown[0]} is not supported "
                                                             f"by pagedkv (known: {', '.join(STRUCTURED_KEYS)})")
    return _make("structured_outputs", {k: v for k, v in value.items() if v is not None})


def _make(field: str, kwargs: dict[str, Any]) -> StructuredOutputs:
    choice = kwargs.get("choice")
    if isinstance(choice, list) and len(choice) > MAX_CHOICES:
        raise InvalidField(field, f"{field}: a choice of {len(choice):,} entries is over pagedkv's limit of "
                                  f"{MAX_CHOICES:,} (use a regex or a grammar)")
    try:
        return StructuredOutputs(**kwargs)
    except RequestRejected as exc:
        message = str(exc).replace("structured_outputs", field, 1) if field != "structured_outputs" else str(exc)
        raise InvalidField(field, message) from None
