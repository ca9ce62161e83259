"""Batch files in the OpenAI batch format (what ``vllm run-batch`` reads and writes).

Each input line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}``. Each output line is ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``, written as soon as its request finishes, so a
crash loses nothing that had finished. A bad line (bad JSON, invalid UTF-8, a lone surrogate,
a bad field) gets an error line of its own; the rest run. Every line is read and checked
before the first request runs. Fields are read as ``engine serve`` reads them: strict types,
``null`` = not set, unknown fields refused, the same roles, content parts and caps
(``serve/request_rules.py``, ``serve/sampling_fields.py``), and logprobs come back in the
same OpenAI shapes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.errors import PagedKVError
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.serve import request_rules as rules
from pagedkv.serve.logprobs_format import TokenTexts, chat_logprobs, completion_logprobs, prompt_logprobs_json
from pagedkv.serve.sampling_fields import FieldError, sampling_extras
from pagedkv.serve.structured_fields import FIELDS as STRUCTURED_FIELDS
from pagedkv.serve.structured_fields import structured_from_body

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
# OpenAI body field -> SamplingParams field; pagedkv's extras (top_k, min_tokens, ...) keep their names
_PARAM_FIELDS = {
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
    "top_p": "top_p", "n": "n", "stop": "stop", "seed": "seed", "top_k": "top_k", "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
}
# read by sampling_extras (shared with engine serve)
_EXTRA_FIELDS = {"min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
                 "top_logprobs", "prompt_logprobs"}
_IGNORED_FIELDS = {"model", "user", "stream", "stream_options", "messages", "prompt"}
# the types engine serve's request model gives these fields (strict: no "5", true or 5.0 for an integer)
_INTEGER_FIELDS = {"max_tokens", "max_completion_tokens", "n", "seed", "top_k", "min_tokens"}
_NUMBER_FIELDS = {"temperature", "top_p"}
_BOOLEAN_FIELDS = {"ignore_eos", "stream"}


class BatchLineError(PagedKVError):
    """One line of a batch file cannot run; it gets an error line, the others go on."""


@dataclass
class BatchRequest:
    custom_id: str
    url: str
    prompts: list[list[int]]  # token ids, one entry per prompt (a completion may carry several)
    params: SamplingParams
    engine_ids: list[str] = field(default_factory=list)


def parse_line(line: str | bytes, tokenizer: Any, default_max_tokens: int, vocab_size: int | None = None
               ) -> BatchRequest:
    """Check one input line and turn its body into token ids and sampling parameters."""
    try:
        item = rules.parse_json_object(line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line)
    except FieldError as exc:
        raise BatchLineError(exc.message.replace("the body", "the line")) from None
    custom_id, url, body = item.get("custom_id"), item.get("url"), item.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchLineError("'custom_id' must be a non-empty string")
    if item.get("method", "POST") != "POST":
        raise BatchLineError(f"{custom_id}: 'method' must be POST")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise BatchLineError(f"{custom_id}: 'url' must be {CHAT_URL} or {COMPLETIONS_URL}, got {url!r}")
    if not isinstance(body, dict):
        raise BatchLineError(f"{custom_id}: 'body' must be an object")
    unknown = sorted(set(body) - set(_PARAM_FIELDS) - _EXTRA_FIELDS - _IGNORED_FIELDS - set(STRUCTURED_FIELDS))
    if unknown:
        raise BatchLineError(f"{custom_id}: unsupported field(s) in body: {', '.join(unknown)}")
    _check_types(custom_id, body)
    kwargs: dict[str, Any] = {"max_tokens": default_max_tokens}
    for key, name in _PARAM_FIELDS.items():
        if body.get(key) is not None:
            kwargs[name] = body[key]
    try:
        kwargs["stop"] = rules.stop_strings(body.get("stop"))
        if body.get("logit_bias") is not None and isinstance(body["logit_bias"], dict):
            rules.count_cap("logit_bias", body["logit_bias"], rules.MAX_LOGIT_BIAS, "entries")
        kwargs.update(sampling_extras(body, url == CHAT_URL, vocab_size))
        kwargs["structured"] = structured_from_body(body)[0]
        params = SamplingParams(**kwargs)
    except (TypeError, ValueError) as exc:  # FieldError and RequestRejected are ValueErrors
        raise BatchLineError(f"{custom_id}: {exc}") from None
    prompts = _chat_prompt(custom_id, body, tokenizer) if url == CHAT_URL else _completion_prompts(custom_id, body,
                                                                                                   tokenizer)
    return BatchRequest(custom_id, url, prompts, params)


def _check_types(custom_id: str, body: dict) -> None:
    for key, value in body.items():
        if value is None:
            continue
        if key in _INTEGER_FIELDS and (isinstance(value, bool) or not isinstance(value, int)):
            raise BatchLineError(f"{custom_id}: {key} must be an integer, got {value!r}")
        if key in _NUMBER_FIELDS and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise BatchLineError(f"{custom_id}: {key} must be a number, got {value!r}")
        if key in _BOOLEAN_FIELDS and not isinstance(value, bool):
            raise BatchLineError(f"{custom_id}: {key} must be true or false, got {value!r}")


def _chat_prompt(custom_id: str, body: dict, tokenizer: Any) -> list[list[int]]:
    from pagedkv.core.llm import apply_chat_template

    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BatchLineError(f"{custom_id}: 'messages' must be a non-empty list of {{role, content}} objects")
    conversation = []
    try:
        rules.count_cap("messages", messages, rules.MAX_MESSAGES, "messages")
        for index, message in enumerate(messages):
            unknown = sorted(set(message) - {"role", "content", "name"})
            if unknown:
                raise FieldError(f"messages.{index}", f"messages.{index}: unknown field(s) {', '.join(unknown)}")
            rules.check_role(message.get("role"))
            if message.get("name") is not None and not isinstance(message["name"], str):
                raise FieldError("name", "name must be a string")
            conversation.append({"role": message["role"], "content": rules.content_text(message.get("content"))})
    except FieldError as exc:
        raise BatchLineError(f"{custom_id}: messages: {exc.message}") from None
    if getattr(tokenizer, "chat_template", None) is None:
        raise BatchLineError(f"{custom_id}: this model has no chat template; use {COMPLETIONS_URL} with a prompt")
    try:
        return [apply_chat_template(tokenizer, conversation)]
    except Exception as exc:  # noqa: BLE001 - a template that raises on these messages: this line only
        raise BatchLineError(f"{custom_id}: the chat template refused these messages: {type(exc).__name__}: "
                             f"{str(exc)[:200]}") from None


def _completion_prompts(custom_id: str, body: dict, tokenizer: Any) -> list[list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BatchLineError(f"{custom_id}: 'prompt' must be a string, a list of strings or a list of token ids")
    if len(prompt) > rules.MAX_PROMPTS:
        raise BatchLineError(f"{custom_id}: prompt has {len(prompt)} prompts; at most {rules.MAX_PROMPTS} are allowed")
    prompts = []
    for p in prompt:
        if isinstance(p, str):
            prompts.append(list(tokenizer(p)["input_ids"]))
        elif isinstance(p, list) and p and all(type(t) is int for t in p):
            prompts.append(p)
        else:
            raise BatchLineError(f"{custom_id}: each prompt must be a string or a non-empty list of token ids")
    return prompts


def error_line(custom_id: str | None, message: str, status_code: int = 400) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": f"req_{uuid.uuid4().hex}",
                     "body": {"error": {"message": message, "type": "invalid_request_error"}}},
        "error": {"code": "invalid_request" if status_code == 400 else "server_error", "message": message},
    }


def response_line(request: BatchRequest, outputs: list[Any], model_name: str, texts: TokenTexts | None = None) -> dict:
    """The OpenAI response object for a finished request (``outputs``: one RequestOutput per prompt);
    ``texts`` spells the tokens of the logprobs, when the request asked for them."""
    failed = [c.error or "request failed" for out in outputs for c in out.outputs if c.finish_reason == "error"]
    if failed:
        return error_line(request.custom_id, failed[0], status_code=500)
    chat = request.url == CHAT_URL
    texts = texts or TokenTexts(None)
    choices = []
    for out in outputs:
        for c in out.outputs:
            choice: dict[str, Any] = {"index": len(choices), "finish_reason": _finish_reason(c.finish_reason),
                                      "logprobs": _logprobs(request.params, c, chat, texts)}
            if chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
                if out.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, texts)
            choices.append(choice)
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    completion_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }
    if chat and outputs[0].prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(outputs[0].prompt_logprobs, texts)
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id,
            "response": {"status_code": 200, "request_id": body["id"], "body": body}, "error": None}


def _logprobs(params: SamplingParams, completion: Any, chat: bool, texts: TokenTexts) -> Any:
    if params.logprobs is None or completion.logprobs is None:
        return None
    if chat:
        return chat_logprobs(completion.token_ids, completion.logprobs, params.logprobs, texts)
    return completion_logprobs(completion.token_ids, completion.logprobs, params.logprobs, texts)


def _finish_reason(reason: str | None) -> str | None:
    return "stop" if reason in ("stop", "abort") else reason


def run_batch(
    engine: Any, lines: Iterable[str | bytes], write: Callable[[dict], None], model_name: str,
    default_max_tokens: int = 256, on_finish: Callable[[], None] | None = None,
) -> tuple[int, int]:
    """Run every line through ``engine``, calling ``write`` with each output line as it is ready.

    Returns (succeeded, failed) counts.
    """
    from pagedkv.core.errors import RequestRejected

    pending: dict[str, tuple[BatchRequest, dict[str, Any]]] = {}  # engine request id -> (request, outputs so far)
    ok = bad = 0
    texts = TokenTexts(engine.tokenizer)
    checked: list[tuple[int, BatchRequest | BatchLineError, str | bytes]] = []
    for number, line in enumerate(lines, 1):  # every line is read and checked before any runs
        if not line.strip():
            continue
        try:
            checked.append((number, parse_line(line, engine.tokenizer, default_max_tokens, engine.vocab_size), line))
        except BatchLineError as exc:
            checked.append((number, exc, line))
    for number, request, line in checked:
        if isinstance(request, BatchLineError):
            write(error_line(_custom_id_of(line), f"line {number}: {request}"))
            bad += 1
            continue
        try:
            if request.params.structured is not None:  # compiled before any step runs: a bad schema is a 400 line
                engine.check_structured(request.params.structured)
            for prompt in request.prompts:
                request.engine_ids.append(engine.add_request(prompt, request.params))
        except RequestRejected as exc:
            for rid in request.engine_ids:  # a request runs whole or not at all
                engine.abort(rid)
            write(error_line(request.custom_id, f"line {number}: {exc}"))
            bad += 1
            continue
        results: dict[str, Any] = {}
        for rid in request.engine_ids:
            pending[rid] = (request, results)
    while engine.has_unfinished():
        for out in engine.step(stream=False):
            request, results = pending.pop(out.request_id)
            results[out.request_id] = out
            if len(results) == len(request.engine_ids):
                line = response_line(request, [results[r] for r in request.engine_ids], model_name, texts)
                write(line)
                ok, bad = (ok + 1, bad) if line["error"] is None else (ok, bad + 1)
                if on_finish is not None:
                    on_finish()
    return ok, bad


def _custom_id_of(line: str | bytes) -> str | None:
    try:
        item = json.loads(line.decode("utf-8", "replace") if isinstance(line, bytes) else line)
    except (ValueError, RecursionError):
        return None
    value = item.get("custom_id") if isinstance(item, dict) else None
    return value if isinstance(value, str) and rules.lone_surrogate_path(value) is None else None
