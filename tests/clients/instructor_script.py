"""instructor, unmodified, against the server at argv[1] (model argv[2], logit_bias argv[3] as JSON): run by
tests/clients/test_instructor_client.py with the Python of .venv-clients (instructor pins jiter<0.15, which the
project venv's openai cannot take). Prints one JSON object: per mode, the validated model and what the answer
carried. Exit 77: instructor is not installed here."""

from __future__ import annotations

import json
import sys

from pydantic import BaseModel, Field

try:
    import instructor
    import openai
except ImportError as missing:
    print(f"instructor is not installed in {sys.prefix}: {missing}")
    sys.exit(77)


class Stop(BaseModel):
    day: int = Field(ge=1, le=9)


class Trip(BaseModel):
    """tests/clients/client_server.py's Trip: four objects that leave additionalProperties unset."""

    first: Stop
    second: Stop
    third: Stop


def main(url: str, model: str, logit_bias: dict[str, int]) -> None:
    results = {"versions": {"instructor": instructor.__version__, "openai": openai.__version__}}
    for mode in ("TOOLS", "JSON_SCHEMA"):
        raw = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
        trip, completion = client.chat.completions.create_with_completion(
            model=model, response_model=Trip, max_retries=1, max_tokens=120, temperature=0, logit_bias=logit_bias,
            messages=[{"role": "user", "content": "Plan a trip."}])
        message = completion.choices[0].message
        results[mode] = {"trip": trip.model_dump(), "finish_reason": completion.choices[0].finish_reason,
                         "tool_calls": [call.function.name for call in message.tool_calls or []],
                         "content": message.content}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))  # argv[3]: client_server.COMMA_BIAS as JSON
