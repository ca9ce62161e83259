"""JSON schemas closed to unlisted keys: an object schema that lists ``properties`` but leaves
``additionalProperties`` unset gets ``additionalProperties: false``, at every depth.

JSON Schema allows unlisted keys by default, and llguidance generates them, so a small model given a
pydantic model's schema (which never sets the keyword) invents keys until its token budget runs out.
vLLM's default grammar backend (xgrammar) never generates unlisted keys; closing the schema before it is
compiled gives the same output here. A schema that sets ``additionalProperties`` (true, false or a
schema) keeps it, and an object schema with no ``properties`` (``{"type": "object"}``: any object) stays
open. The members of an ``allOf`` are parts of one object, so they are not closed one by one (each would
forbid the others' keys, and the whole could not be satisfied): the schema holding the ``allOf`` is closed
instead, to the keys its members list. The caller's schema is never modified: the closed one is a copy.
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


def _lists_keys(node: dict[str, Any]) -> bool:
    return isinstance(node.get("properties"), dict) or isinstance(node.get("patternProperties"), dict)


def _close(node: Any, fragment: bool = False) -> None:
    """Close ``node`` and everything under it; a ``fragment`` (an ``allOf`` member) only below itself."""
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
        if key == "allOf" and isinstance(value, list):
            for member in value:
                _close(member, fragment=True)
        elif isinstance(value, (dict, list)):
            _close(value)
    if fragment or "additionalProperties" in node:
        return
    members = [m for m in node.get("allOf", ()) if isinstance(m, dict) and _lists_keys(m)]
    if any("patternProperties" in m or m.get("additionalProperties", False) is not False for m in members):
        return  # a member that lets other keys in (by pattern or explicitly) keeps the whole open
    if members:
        # the whole object may hold every key a member lists (the members still check their values)
        properties = node.setdefault("properties", {})
        if isinstance(properties, dict):
            for member in members:
                for name in member.get("properties") or {}:
                    properties.setdefault(name, True)
    if _lists_keys(node):
        node["additionalProperties"] = False
