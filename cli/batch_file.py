"""Batch files in the OpenAI batch format (what ``vllm run-batch`` reads and writes).

Each input line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}``. Each output line is ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``, written as soon as its request finishes, so a
crash loses nothing that had finished. A bad line (bad JSON, invalid UTF-8, a lone surrogate,
a bad field) gets an error line of its own; the rest run. Every line is read and checked
before the first request runs. A body takes exactly the fields ``engine serve`` takes
(``cli/batch_fields.py``), read as it reads them: strict types, ``null`` = not set, unknown
fields refused, the same roles, content parts, caps and vLLM fields (``serve/request_rules.py``,
``serve/sampling_fields.py``, ``serve/vllm_fields.py``, ``serve/chat_fields.py``); echo, token
ids, forced tool calls and logprobs come back in the same OpenAI shapes. An unset
``max_tokens`` is the run's ``--max-tokens``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedkv.cli.batch_fields import MESSAGE_FIELDS, check_body, check_types
from pagedkv.core.errors import PagedKVError
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.serve import chat_fields, vllm_fields
from pagedkv.serve import request_rules as rules
from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.logprobs_format import TokenTexts, chat_logprobs, completion_logprobs, prompt_logprobs_json
from pagedkv.serve.sampling_fields import sampling_extras
from pagedkv.serve.structured_fields import structured_from_body
from pagedkv.serve.structured_request import Parsers, combined_constraint
from pagedkv.serve.tools import check_tools, tool_choice_of

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
# OpenAI body field -> SamplingParams field; pagedkv's extras (top_k, min_tokens, ...) keep their names
_PARAM_FIELDS = {
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
    "top_p": "top_p", "n": "n", "stop": "stop", "seed": "seed", "top_k": "top_k", "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos",
}


class BatchLineError(PagedKVError):
    """One line of a batch file cannot run; it gets an error line, the others go on."""


@dataclass
class BatchRequest:
    custom_id: str
    url: str
    prompts: list[list[int]]  # token ids, one entry per prompt (a completion may carry several)
    params: SamplingParams
    engine_ids: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)  # add_request's cache_salt, priority
    echo: list[str] | None = None  # per prompt: text that starts each of its choices (vLLM's echo)
    return_token_ids: bool = False
    shaper: Any = None  # ChatShaper: a forced tool choice's calls parsed out of the answer


def parse_line(line: str | bytes, tokenizer: Any, default_max_tokens: int, vocab_size: int | None = None
               ) -> BatchRequest:
    """Check one input line and turn its body into token ids and sampling parameters, as engine serve would."""
    try:
        item = rules.parse_json_object(line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line)
    except InvalidField as exc:
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
    chat = url == CHAT_URL
    try:
        value = check_body(chat, body)
        kwargs: dict[str, Any] = {"max_tokens": default_max_tokens}
        for key, name in _PARAM_FIELDS.items():
            if body.get(key) is not None:
                kwargs[name] = body[key]
        kwargs["stop"] = rules.stop_strings(body.get("stop"))
        if body.get("logit_bias") is not None and isinstance(body["logit_bias"], dict):
            rules.count_cap("logit_bias", body["logit_bias"], rules.MAX_LOGIT_BIAS, "entries")
        kwargs.update(sampling_extras(body, chat, vocab_size))
        kwargs.update(vllm_fields.sampling_kwargs(value))
        tools, choice = ([], None)
        if chat:
            tools = check_tools(body["tools"]) if body.get("tools") is not None else []
            choice = tool_choice_of(body.get("tool_choice"), tools)
            Parsers(None, None, False, None).check_choice(choice)  # no --tool-call-parser in a batch run
        structured, source = structured_from_body(body)
        kwargs["structured"] = combined_constraint(structured, source, choice, tools)[0]
        params = SamplingParams(**kwargs)
        if chat:
            prompts, echo = _chat_prompt(custom_id, body, value, tools, tokenizer)
        else:
            prompts, echo = _completion_prompts(custom_id, body, value("add_special_tokens"), tokenizer)
    except (InvalidField, TypeError, ValueError) as exc:  # RequestRejected is a ValueError
        raise BatchLineError(f"{custom_id}: {exc}") from None
    shaper = Parsers(None, None, False, None).shaper(choice) if chat else None
    return BatchRequest(custom_id, url, prompts, params, options=vllm_fields.engine_options(value),
                        echo=echo if value("echo") else None, return_token_ids=bool(value("return_token_ids")),
                        shaper=shaper)


def _chat_prompt(custom_id: str, body: dict, value: Any, tools: list[dict[str, Any]], tokenizer: Any
                 ) -> tuple[list[list[int]], list[str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BatchLineError(f"{custom_id}: 'messages' must be a non-empty list of {{role, content}} objects")
    conversation = []
    try:
        rules.count_cap("messages", messages, rules.MAX_MESSAGES, "messages")
        for index, message in enumerate(messages):
            check_types(MESSAGE_FIELDS, message, f"messages.{index}.")
            rules.check_role(message.get("role"))
            conversation.append(chat_fields.for_template(
                message["role"], rules.content_text(message.get("content")), message.get("name"),
                message.get("tool_call_id"), message.get("tool_calls")))
    except InvalidField as exc:
        raise BatchLineError(f"{custom_id}: messages: {exc.message}") from None
    arguments = {**chat_fields.template_arguments(value), "tools": tools or None}
    if getattr(tokenizer, "chat_template", None) is None and not arguments.get("chat_template"):
        raise BatchLineError(f"{custom_id}: this model has no chat template; use {COMPLETIONS_URL} with a prompt")
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, **arguments)
    except Exception as exc:  # noqa: BLE001 - a template that raises on these messages: this line only
        raise BatchLineError(f"{custom_id}: the chat template refused these messages: {type(exc).__name__}: "
                             f"{str(exc)[:200]}") from None
    last = conversation[-1]
    echo = last["content"] if last["role"] == "assistant" else ""
    return [list(tokenizer(text, add_special_tokens=value("add_special_tokens"))["input_ids"])], [echo]


def _completion_prompts(custom_id: str, body: dict, add_special_tokens: bool, tokenizer: Any
                        ) -> tuple[list[list[int]], list[str]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BatchLineError(f"{custom_id}: 'prompt' must be a string, a list of strings or a list of token ids")
    if len(prompt) > rules.MAX_PROMPTS:
        raise BatchLineError(f"{custom_id}: prompt has {len(prompt)} prompts; at most {rules.MAX_PROMPTS} are allowed")
    prompts, texts = [], []
    for p in prompt:
        if isinstance(p, str) and p:
            prompts.append(list(tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"]))
            texts.append(p)
        elif isinstance(p, list) and p and all(type(t) is int for t in p):
            prompts.append(p)
            texts.append(tokenizer.decode(p) if body.get("echo") else "")
        else:
            raise BatchLineError(f"{custom_id}: each prompt must be a non-empty string or a non-empty list of "
                                 "token ids")
    return prompts, texts


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
    for p, out in enumerate(outputs):
        for c in out.outputs:
            choice: dict[str, Any] = {"index": len(choices), "finish_reason": _finish_reason(c.finish_reason),
                                      "logprobs": _logprobs(request.params, c, chat, texts)}
            text = (request.echo[p] if request.echo else "") + c.text
            if chat and request.shaper is not None:
                choice["message"], calls = request.shaper.message(text)
                if calls and c.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
            elif chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
                if out.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, texts)
            if request.return_token_ids:  # vLLM's return_token_ids, placed as engine serve places them
                if not chat:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choice["token_ids"] = list(c.token_ids)
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
    if chat and request.return_token_ids:
        body["prompt_token_ids"] = list(outputs[0].prompt_token_ids)
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
                request.engine_ids.append(engine.add_request(prompt, request.params, **request.options))
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
