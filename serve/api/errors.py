"""The one error a bad request field raises, and OpenAI's error envelope it is answered with.

``InvalidField`` is deliberately not a ``ValueError``: raised inside a model's validator it passes
through pydantic unchanged, so the field it names and its message reach the client as written.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError


class InvalidField(Exception):
    """A request field the server refuses: answered ``status`` (400) with the field as ``param``."""

    def __init__(self, param: str | None, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.message, self.status, self.kind = param, message, status, kind

    def body(self) -> dict[str, Any]:
        """This error in OpenAI's envelope."""
        return error_body(self.message, self.kind, self.param, self.status)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def parse_body(model: type[BaseModel], data: Any) -> Any:
    """``data`` validated as ``model``; a type error is an :class:`InvalidField` naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = validation_error_body(list(exc.errors(include_url=False)))["error"]
        raise InvalidField(error["param"], error["message"]) from None


def validation_error_body(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """A pydantic/FastAPI validation failure as one OpenAI error naming the first bad field."""
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # a union type adds its member type names to the location: keep the field path only
    param = ".".join(p for p in loc if not _is_type_name(p)) or None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        message = "unknown field: pagedkv does not know it (check its spelling)"
    if param:
        message = f"{param}: {message}"
    return error_body(message, param=param, code=400)


def _is_type_name(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list[int]", "list[str]", "list[list[int]]"} or (
        "[" in part or part.startswith("function-")
    )
