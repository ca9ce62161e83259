"""The base of every request body the server and batch files validate: strict types, no unknown fields."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class StrictBody(BaseModel):
    """No coercion, unknown fields refused, and a field sent as ``null`` is a field not sent."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data
