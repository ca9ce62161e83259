"""JSON schemas closed to unlisted keys: an object schema that lists ``properties`` but leaves
``additionalProperties`` unset gets ``additionalProperties: false``, at every depth.

JSON Schema allows unlisted keys by default, and llguidance generates them, so a small model given a
pydantic model's schema (which never sets the keyword) invents keys until its token budget runs out.
vLLM's default grammar backend (xgrammar) never generates unlisted keys; closing the schema before it is
compiled gives the same output here. A schema that sets ``additionalProperties`` (true, false or a
schema) keeps it, and an object schema with no ``properties`` (``{"type": "object"}``: any object) stays
open. The caller's schema is never modified: the closed one is a copy.
"""

from __future__ import annotations

import copy
from typing import Any

# keywords whose value maps names to subschemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
# keywords whose value is a subschema or a list of them
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "prefixItems",
               "additionalItems", "unevaluatedItems", "contains", "allOf", "anyOf", "oneOf", "not", "if", "then",
               "else")


def closed_schema(schema: Any) -> Any:
    """A copy of ``schema`` with every object schema that lists properties closed to unlisted keys."""
    if not isinstance(schema, (dict, list)):
        return schema  # true / false: nothing to close
    closed = copy.deepcopy(schema)
    _close(closed)
    return closed


def _close(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _close(item)
        return
    if not isinstance(node, dict):
        return
    for key in _SCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            for sub in value.values():
                _close(sub)
    for key in _SUBSCHEMAS:
        value = node.get(key)
        if isinstance(value, (dict, list)):
            _close(value)
    lists_keys = isinstance(node.get("properties"), dict) or isinstance(node.get("patternProperties"), dict)
    if lists_keys and "additionalProperties" not in node:
        node["additionalProperties"] = False
