"""The request schema of ``engine serve`` and ``engine run --input``: one pydantic model per endpoint.

Each model declares its fields with their types and checks its own rules, and returns what the
engine takes (``SamplingParams`` and the prompt); a bad field is one :class:`~.errors.InvalidField`.
The HTTP server and the batch-file runner both parse a body through these models, so a field means
the same, and is refused for the same reason, in both.

- ``completion.py``, ``chat.py``, ``tokenize_request.py``: the endpoints' models;
- ``responses_request.py`` (+ ``responses_input.py``): the Responses API's body, turned into a chat request;
- ``generation.py``: the fields completions and chat share, the answer's length, ``to_sampling_params``;
- ``sampling.py``, ``vllm.py``, ``structured.py``, ``tools.py``: each group of fields and its rules;
- ``errors.py`` (the error and OpenAI's envelope), ``json_body.py`` (bytes -> JSON), ``strict_body.py``.
"""
