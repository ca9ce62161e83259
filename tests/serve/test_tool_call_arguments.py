"""A history tool call's ``function.arguments`` string that is not JSON is a 400 that says so (issue 42)."""

from __future__ import annotations

import pytest

from pagedkv.serve.api.chat import parsed_call
from pagedkv.serve.api.errors import InvalidField


def _call(arguments: object) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}


def test_invalid_json_arguments_say_they_are_not_valid_json() -> None:
    with pytest.raises(InvalidField) as info:
        parsed_call(_call('{"city": "Par'))
    assert "is not valid JSON" in str(info.value) and "must be a JSON string" not in str(info.value)
    assert "character" in str(info.value)


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deeply_nested_arguments_are_a_400_not_a_recursion_error(depth: int) -> None:
    with pytest.raises(InvalidField) as info:
        parsed_call(_call('{"a": ' * depth + "1" + "}" * depth))
    assert "nested too deeply" in str(info.value)


def test_valid_arguments_are_parsed_for_the_template() -> None:
    assert parsed_call(_call('{"city": "Paris"}'))["function"]["arguments"] == {"city": "Paris"}
    already = {"function": {"name": "f", "arguments": {"already": 1}}}
    assert parsed_call(already)["function"]["arguments"] == {"already": 1}
