"""``tool_choice: required`` over tools whose parameters use ``$defs`` (a Pydantic model with a nested model, as
pydantic-ai's output tool and LangChain's tools send): the array grammar nests each tool's parameters, so their
definitions move to its root, where ``#/$defs/X`` resolves (as vLLM does). Before, the grammar did not compile (400
"Pointer '/$defs/Stop' does not exist")."""

from __future__ import annotations

import jsonschema
import pytest

from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.api.tools import ToolChoice, forced_constraint

STOP = {"type": "object", "properties": {"day": {"type": "integer"}}, "required": ["day"]}
TRIP = {"type": "object", "properties": {"first": {"$ref": "#/$defs/Stop"}}, "required": ["first"],
        "$defs": {"Stop": STOP}}
LEG = {"type": "object", "properties": {"to": {"$ref": "#/definitions/Stop"}, "at": {"$ref": "#/$defs/Stop"}},
       "$defs": {"Stop": STOP}, "definitions": {"Stop": STOP}}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_required_hoists_the_definitions_to_the_root_where_references_resolve():
    schema = forced_constraint(ToolChoice("required"), [tool("trip", TRIP), tool("leg", LEG)]).json
    assert set(schema["$defs"]) == {"Stop"} and set(schema["definitions"]) == {"Stop"}
    calls = [{"name": "trip", "parameters": {"first": {"day": 3}}},
             {"name": "leg", "parameters": {"to": {"day": 1}, "at": {"day": 2}}}]
    jsonschema.validate(calls, schema)
    with pytest.raises(jsonschema.ValidationError):  # the referenced definition is the one applied, closed too
        jsonschema.validate([{"name": "trip", "parameters": {"first": {"day": 3, "extra": 1}}}], schema)


def test_one_name_defined_two_ways_is_refused_naming_tools():
    other = {**TRIP, "$defs": {"Stop": {"type": "string"}}}
    with pytest.raises(InvalidField) as refused:
        forced_constraint(ToolChoice("required"), [tool("trip", TRIP), tool("other", other)])
    assert refused.value.param == "tools" and "$defs/Stop" in str(refused.value)


def test_a_named_choice_keeps_its_definitions_in_place():
    schema = forced_constraint(ToolChoice("named", "trip"), [tool("trip", TRIP)]).json
    jsonschema.validate({"first": {"day": 3}}, schema)
