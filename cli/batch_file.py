"""Batch files in the OpenAI batch format (what ``vllm run-batch`` reads and writes).

Each input line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}``. Each output line is ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``, written as soon as its request finishes, so a
crash loses nothing that had finished. A bad line (bad JSON, invalid UTF-8, a lone surrogate,
a bad field) gets an error line of its own; the rest run. Every line is read and checked
before the first request runs. A body is parsed by the request models ``engine serve`` parses
it with (``serve/api/``), so it takes the same fields with the same types, rules and meaning;
echo, token ids, forced tool calls and logprobs come back in the same OpenAI shapes. An unset
``max_tokens`` is the run's ``--max-tokens``, and an unset ``temperature`` is greedy.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.errors import PagedKVError
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.serve.api.chat import ChatCompletionRequest, render_chat
from pagedkv.serve.api.completion import ServedCompletionRequest
from pagedkv.serve.api.errors import InvalidField, parse_body
from pagedkv.serve.api.json_body import lone_surrogate_path, parse_json_object
from pagedkv.serve.logprobs_format import TokenTexts, chat_logprobs, completion_logprobs, prompt_logprobs_json
from pagedkv.serve.structured_request import Parsers

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
# the fields a batch line leaves unset that differ from the server's defaults: a run is greedy by default
BATCH_SAMPLING_DEFAULTS = {"temperature": 0.0}
_NO_PARSERS = Parsers(None, None, False, None)  # a batch run has no --tool-call-parser or --reasoning-parser


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
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, the one token sampled left out (not its usage)


def parse_line(line: str | bytes, tokenizer: Any, default_max_tokens: int, vocab_size: int | None = None,
               model_name: str = "this model") -> BatchRequest:
    """Check one input line and turn its body into token ids and sampling parameters, as engine serve would."""
    try:
        item = parse_json_object(line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line)
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
    try:
        if url == CHAT_URL:
            return _chat_request(custom_id, parse_body(ChatCompletionRequest, body), tokenizer, default_max_tokens,
                                 vocab_size, model_name)
        return _completion_request(custom_id, parse_body(ServedCompletionRequest, body), tokenizer,
                                   default_max_tokens, vocab_size)
    except InvalidField as exc:
        raise BatchLineError(f"{custom_id}: {exc.message}") from None
    except ValueError as exc:  # the tokenizer refusing a text
        raise BatchLineError(f"{custom_id}: {exc}") from None


def _chat_request(custom_id: str, request: ChatCompletionRequest, tokenizer: Any, default_max_tokens: int,
                  vocab_size: int | None, model_name: str) -> BatchRequest:
    tools, choice = request.tool_setup()
    _NO_PARSERS.check_choice(choice)
    constraint, _ = request.constraint(choice, tools)
    params = _sampling_params(request, default_max_tokens, vocab_size, constraint)
    arguments = {**request.template_arguments(), "tools": tools or None}
    text = render_chat(tokenizer, model_name, request.conversation(), arguments)
    prompt = list(tokenizer(text, add_special_tokens=request.add_special_tokens)["input_ids"])
    return BatchRequest(custom_id, CHAT_URL, [prompt], params, options=request.engine_options(),
                        echo=[request.echo_text()] if request.echo else None,
                        return_token_ids=bool(request.return_token_ids), shaper=_NO_PARSERS.shaper(choice, tools))


def _completion_request(custom_id: str, request: ServedCompletionRequest, tokenizer: Any, default_max_tokens: int,
                        vocab_size: int | None) -> BatchRequest:
    params = _sampling_params(request, default_max_tokens, vocab_size, request.constraint()[0])
    prompts, texts = [], []
    for prompt in request.prompts():
        if isinstance(prompt, str):
            prompts.append(list(tokenizer(prompt, add_special_tokens=request.add_special_tokens)["input_ids"]))
            texts.append(prompt)
        else:
            prompts.append(prompt)
            texts.append(tokenizer.decode(prompt) if request.echo else "")
    return BatchRequest(custom_id, COMPLETIONS_URL, prompts, params, options=request.engine_options(),
                        echo=texts if request.echo else None, return_token_ids=bool(request.return_token_ids),
                        echo_only=request.echo_only)


def _sampling_params(request: Any, default_max_tokens: int, vocab_size: int | None, constraint: Any
                     ) -> SamplingParams:
    return request.to_sampling_params(request.max_tokens_or(default_max_tokens), vocab_size,
                                      BATCH_SAMPLING_DEFAULTS, constraint)


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
    choices, completion_tokens = [], 0
    for p, out in enumerate(outputs):
        # echo with logprobs on a completion: the prompt's tokens lead (the first null), as engine serve answers
        prompt = (out.prompt_token_ids, out.prompt_logprobs) if request.echo and not chat and \
            out.prompt_logprobs is not None else None
        for c in out.outputs:
            completion_tokens += len(c.token_ids)  # echo_only's sampled token too, as vLLM counts it
            c = _hide_sampled(c) if request.echo_only else c
            choice: dict[str, Any] = {"index": len(choices), "finish_reason": _finish_reason(c.finish_reason),
                                      "logprobs": _logprobs(request.params, c, chat, texts, prompt)}
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


def _hide_sampled(completion: Any) -> Any:
    """A choice of ``max_tokens: 0`` with echo, without the token the engine had to sample to run the prompt."""
    return dataclasses.replace(completion, text="", token_ids=[], cumulative_logprob=None,
                               logprobs=None if completion.logprobs is None else [])


def _logprobs(params: SamplingParams, completion: Any, chat: bool, texts: TokenTexts,
              prompt: tuple[list[int], list[Any]] | None = None) -> Any:
    """The choice's logprobs object (None unless asked for), after the echoed ``prompt``'s ids and entries."""
    if params.logprobs is None or completion.logprobs is None:
        return None
    if chat:
        return chat_logprobs(completion.token_ids, completion.logprobs, params.logprobs, texts)
    ids, entries = list(completion.token_ids), list(completion.logprobs)
    if prompt is not None:
        ids, entries = [*prompt[0], *ids], [*prompt[1], *entries]
    return completion_logprobs(ids, entries, params.logprobs, texts)


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
            checked.append((number, parse_line(line, engine.tokenizer, default_max_tokens, engine.vocab_size,
                                               model_name), line))
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
    return value if isinstance(value, str) and lone_surrogate_path(value) is None else None
