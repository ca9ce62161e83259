"""The schema rewrite that forbids unlisted keys where a schema leaves ``additionalProperties`` unset, and where
the request side applies it (response_format, structured_outputs, guided_json, forced tool calls)."""

from __future__ import annotations

import copy

import pytest

from pagedkv.serve.api.closed_schema import closed_schema
from pagedkv.serve.api.structured import structured_from_body
from pagedkv.serve.api.tools import ToolChoice, combined_constraint, forced_constraint

CITY = {"properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_an_object_with_properties_is_closed_and_the_input_is_not_touched():
    given = copy.deepcopy(CITY)
    assert closed_schema(given) == {**CITY, "additionalProperties": False}
    assert given == CITY


@pytest.mark.parametrize("value", [True, False, {"type": "integer"}])
def test_a_schema_that_sets_additional_properties_keeps_it(value):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": value}
    assert closed_schema(schema) == schema


@pytest.mark.parametrize("schema", [{"type": "object"}, {}, {"type": "string"}, True, False,
                                    {"type": "array", "items": {"type": "object"}}])
def test_schemas_that_list_no_keys_stay_open(schema):
    assert closed_schema(schema) == schema


def test_every_depth_and_every_keyword_is_walked():
    inner = {"type": "object", "properties": {"x": {"type": "integer"}}}
    closed_inner = {**inner, "additionalProperties": False}
    schema = {
        "type": "object",
        "properties": {"nested": inner, "list": {"type": "array", "items": inner},
                       "tuple": {"type": "array", "prefixItems": [inner, {"type": "string"}]},
                       "either": {"anyOf": [inner, {"type": "null"}]}, "one": {"oneOf": [inner]},
                       "all": {"allOf": [inner]}, "ref": {"$ref": "#/$defs/Item"},
                       "open": {"type": "object", "properties": {"y": inner}, "additionalProperties": True},
                       "typed_map": {"type": "object", "additionalProperties": inner}},
        "$defs": {"Item": inner}, "definitions": {"Old": inner},
    }
    out = closed_schema(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["nested"] == closed_inner
    assert props["list"]["items"] == closed_inner
    assert props["tuple"]["prefixItems"] == [closed_inner, {"type": "string"}]
    assert props["either"]["anyOf"][0] == closed_inner and props["one"]["oneOf"] == [closed_inner]
    assert props["all"]["allOf"] == [closed_inner]
    assert props["ref"] == {"$ref": "#/$defs/Item"}
    assert out["$defs"]["Item"] == closed_inner and out["definitions"]["Old"] == closed_inner
    # an open object stays open, but the objects inside it are still closed
    assert props["open"]["additionalProperties"] is True and props["open"]["properties"]["y"] == closed_inner
    assert props["typed_map"] == {"type": "object", "additionalProperties": closed_inner}


def test_a_property_named_like_a_keyword_is_a_property_not_a_keyword():
    schema = {"type": "object", "properties": {"items": {"type": "string"}, "properties": {"type": "integer"}}}
    assert closed_schema(schema)["properties"] == schema["properties"]


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": CITY}}},
    {"structured_outputs": {"json": CITY}},
    {"guided_json": CITY},
    {"guided_json": '{"properties": {"city": {"type": "string"}}, "required": ["city"]}'},
])
def test_every_json_schema_field_is_closed_unless_allowed(body):
    constraint, _ = structured_from_body(body)
    assert constraint.json == {**CITY, "additionalProperties": False}
    constraint, _ = structured_from_body(body, allow_additional_properties=True)
    assert constraint.json == CITY


def test_json_object_and_other_kinds_are_as_given():
    assert structured_from_body({"response_format": {"type": "json_object"}})[0].json_object
    assert structured_from_body({"guided_regex": "a+"})[0].regex == "a+"


TOOLS = [{"type": "function", "function": {"name": "find", "parameters": CITY}},
         {"type": "function", "function": {"name": "bare"}}]


def test_forced_tool_calls_close_the_parameters_schema():
    named = forced_constraint(ToolChoice("named", "find"), TOOLS)
    assert named.json == {**CITY, "additionalProperties": False}
    assert forced_constraint(ToolChoice("named", "find"), TOOLS, allow_additional_properties=True).json == CITY
    required = forced_constraint(ToolChoice("required"), TOOLS).json
    find, bare = required["items"]["anyOf"]
    assert find["properties"]["parameters"] == {**CITY, "additionalProperties": False}
    assert bare["properties"]["parameters"] == {"type": "object"}  # no parameters: any object
    assert TOOLS[0]["function"]["parameters"] == CITY


@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("named", "find")])
def test_a_forced_tool_choice_supersedes_response_format(choice):
    structured, field = structured_from_body({"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}}})
    constraint, source = combined_constraint(structured, field, choice, TOOLS)
    assert source == "tool_choice" and constraint == forced_constraint(choice, TOOLS)


def test_all_of_members_are_one_object_closed_as_a_whole():
    a = {"type": "object", "properties": {"a": {"type": "integer"}, "deep": {"properties": {"x": {}}}},
         "required": ["a"]}
    b = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    out = closed_schema({"allOf": [a, b]})
    assert out["additionalProperties"] is False and set(out["properties"]) == {"a", "b", "deep"}
    assert "additionalProperties" not in out["allOf"][0] and "additionalProperties" not in out["allOf"][1]
    assert out["allOf"][0]["properties"]["deep"]["additionalProperties"] is False
    # a member that lets other keys in keeps the whole open
    opened = closed_schema({"allOf": [a, {**b, "additionalProperties": True}]})
    assert "additionalProperties" not in opened


def test_a_closed_all_of_compiles_and_holds_every_member_key():
    llguidance = pytest.importorskip("llguidance")
    import json

    a = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    b = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(closed_schema({"allOf": [a, b]})))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
