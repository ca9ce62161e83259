"""The attacks of ``hostile_client.py``: one small function each, in a registry the runner reads.

To add one, write a function taking an :class:`AttackRun` and decorate it::

    @attack("my-attack", "what one client does, and what the server should do about it")
    def my_attack(run: AttackRun) -> None:
        while run.going():
            run.record(run.post("/v1/completions", {"prompt": "x"}))

It runs in the attacker's own process (so it cannot slow the measuring one) until ``run.until``;
``run.record`` counts what it got back (a status code, an exception name, or any short text), and
the runner prints the counts and flags every ``500``. Posting attacks should sleep ``run.pause``
between requests (``--pause``); ``control=True`` marks a phase that is not an attack on the server
(the CPU-burn baseline).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx


@dataclass
class AttackRun:
    """What an attack gets: the server's address, its deadline, and a place for what it got back."""

    url: str
    until: float
    pause: float = 0.2
    results: list[str] = field(default_factory=list)

    @property
    def host(self) -> str:
        return self.url.removeprefix("http://").split(":")[0]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def going(self) -> bool:
        return time.monotonic() < self.until

    def record(self, result: object) -> None:
        if isinstance(result, httpx.Response):
            result = result.status_code
        self.results.append(str(result))

    def post(self, path: str, body: object, client: httpx.Client | None = None) -> object:
        """POST ``body`` (JSON, or bytes as they are); the response, or the exception's name."""
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            poster = client or httpx
            return poster.post(self.url + path, content=content, headers={"Content-Type": "application/json"},
                               timeout=120)
        except httpx.HTTPError as exc:
            return type(exc).__name__

    def in_threads(self, count: int, work: Callable[[], None]) -> None:
        self.side_by_side(*[work] * count)

    def side_by_side(self, *works: Callable[[], None]) -> None:
        """Each of ``works`` on its own thread, all at once; returns when every one has."""
        threads = [threading.Thread(target=work) for work in works]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


@dataclass
class Attack:
    name: str
    help: str
    run: Callable[[AttackRun], None]
    control: bool = False


REGISTRY: dict[str, Attack] = {}


def attack(name: str, help: str, control: bool = False) -> Callable[[Callable[[AttackRun], None]], Callable]:
    """Register the decorated function as the attack ``name``."""

    def register(fn: Callable[[AttackRun], None]) -> Callable[[AttackRun], None]:
        REGISTRY[name] = Attack(name, help, fn, control)
        return fn

    return register


def _posting(run: AttackRun, path: str, bodies: list[bytes], clients: int = 4) -> None:
    """``clients`` threads posting ``bodies`` in turn, ``run.pause`` apart, until the deadline."""

    def loop() -> None:
        with httpx.Client(timeout=120) as client:
            turn = 0
            while run.going():
                time.sleep(run.pause)
                run.record(run.post(path, bodies[turn % len(bodies)], client))
                turn += 1

    run.in_threads(clients, loop)


# --- issue 25: bounded work before admission, connections -------------------------------------------------------------


@attack("oversize", "4 clients posting 8 MiB bodies (the limit is 4 MiB: 413 before reading)")
def oversize(run: AttackRun) -> None:
    _posting(run, "/v1/completions", [json.dumps({"prompt": "x" * (8 << 20)}).encode()])


@attack("slowloris", "64 connections sending a header byte every 0.5 s (closed at the header deadline)")
def slowloris(run: AttackRun) -> None:
    socks = []
    for _ in range(64):
        try:
            socks.append(socket.create_connection((run.host, run.port), timeout=2))
        except OSError as exc:
            run.record(type(exc).__name__)
    line = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
    position = 0
    while run.going() and socks:
        for sock in list(socks):
            try:
                sock.send(line[position:position + 1])
            except OSError:
                run.record("closed")
                socks.remove(sock)
        position += 1
        time.sleep(0.5)
    for sock in socks:
        run.record("open at the end")
        sock.close()


@attack("idle", "300 silent sockets, more than the server has descriptors for (EMFILE)")
def idle(run: AttackRun) -> None:
    socks = []
    for _ in range(300):
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect((run.host, run.port))
        except BlockingIOError:
            pass
        except OSError as exc:
            run.record(type(exc).__name__)
        socks.append(sock)
    while run.going():
        time.sleep(0.2)
    closed = 0
    for sock in socks:
        try:
            closed += sock.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        sock.close()
    run.record(f"{closed} of 300 closed by the server")


@attack("stops", "4 clients posting requests with 5,000 stop strings each (400 at validation)")
def stops(run: AttackRun) -> None:
    _posting(run, "/v1/completions", [json.dumps({"prompt": "x", "stop": [f"stop{i}" for i in range(5000)]}).encode()])


@attack("long-prompts", "4 clients posting prompts of 40,000 characters (refused after a bounded tokenization)")
def long_prompts(run: AttackRun) -> None:
    _posting(run, "/v1/completions", [json.dumps({"prompt": "lorem ipsum dolor " * 2222}).encode()])


@attack("cpu-burn", "a control, no traffic: one process spinning, what losing a core costs the stream", control=True)
def cpu_burn(run: AttackRun) -> None:
    spins = 0
    while run.going():
        spins += 1
    run.record("spun")


# --- issue 42: back-pressure and size caps ----------------------------------------------------------------------------


def _stalled_stream(run: AttackRun, body: dict) -> socket.socket | None:
    """A connection that sends a streaming request and then never reads (a tiny receive window)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    try:
        sock.connect((run.host, run.port))
        data = json.dumps(body).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(data) + data)
    except OSError as exc:
        run.record(type(exc).__name__)
        sock.close()
        return None
    return sock


def _gauge(run: AttackRun, name: str) -> str:
    try:
        text = httpx.get(run.url + "/metrics", timeout=10).text
    except httpx.HTTPError as exc:
        return type(exc).__name__
    values = [line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(f"pagedkv:{name}")]
    return values[0] if values else "?"


@attack("slow-reader", "2 streams of n=4 x 900 tokens with logprobs whose client stops reading "
        "(aborted after --stream-stall-timeout: run --seconds 20 to see it; unread outputs replaced, not queued)")
def slow_reader(run: AttackRun) -> None:
    body = {"prompt": "a", "max_tokens": 900, "n": 4, "logprobs": 5, "ignore_eos": True, "stream": True}
    socks = [s for s in (_stalled_stream(run, body) for _ in range(2)) if s is not None]
    while run.going():
        time.sleep(0.2)
    run.record(f"running at the end: {_gauge(run, 'num_requests_running')}")  # 0 once the stall timeout is past
    for sock in socks:
        try:
            sock.setblocking(False)
            head = sock.recv(64)
            run.record(head.split(b"\r\n")[0].decode(errors="replace") or "closed")
        except BlockingIOError:
            run.record("nothing sent")
        except OSError:
            run.record("reset")
        sock.close()


@attack("big-logprobs", "2 clients: chat n=8 x 400 tokens with top_logprobs 20, and 32 prompts of 900 tokens "
        "with prompt_logprobs 20 (400: --max-prompt-logprobs-tokens)")
def big_logprobs(run: AttackRun) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 8, "max_tokens": 400, "logprobs": True,
            "top_logprobs": 20, "ignore_eos": True}
    prompts = {"prompt": [[100 + i] * 900 for i in range(32)], "max_tokens": 1, "prompt_logprobs": 20}

    run.side_by_side(_repeating(run, "chat", _CHAT, chat),
                     _repeating(run, "prompt_logprobs", "/v1/completions", prompts))


@attack("big-tokenize", "4 clients posting /tokenize of 3.9 MB of text and /detokenize of 1.3 M ids (3.9 MB), "
        "under the body cap (400: over the context, counted before parsing)")
def big_tokenize(run: AttackRun) -> None:
    text = json.dumps({"prompt": "lorem ipsum dolor sit amet " * 150_000}).encode()
    ids = json.dumps({"tokens": [7] * 1_300_000}).encode()
    bodies = {"/tokenize": text, "/detokenize": ids}

    def loop() -> None:
        with httpx.Client(timeout=120) as client:
            turn = 0
            while run.going():
                time.sleep(run.pause)
                path = ("/tokenize", "/detokenize")[turn % 2]
                got = run.post(path, bodies[path], client)
                run.record(f"{path[1:]} {got.status_code if isinstance(got, httpx.Response) else got}")
                turn += 1

    run.in_threads(4, loop)


# --- issue 42: templates, grammars, tools, priority -------------------------------------------------------------------

_CHAT = "/v1/chat/completions"
_HI = [{"role": "user", "content": "hi"}]


def _labelled(run: AttackRun, label: str, path: str, body: object, client: httpx.Client | None = None) -> None:
    got = run.post(path, body, client)
    run.record(f"{label} {got.status_code if isinstance(got, httpx.Response) else got}")


def _repeating(run: AttackRun, label: str, path: str, body: object) -> Callable[[], None]:
    """A client that posts ``body`` until the attack ends, recording each answer under ``label``."""
    def go() -> None:
        while run.going():
            time.sleep(run.pause)
            _labelled(run, label, path, body)
    return go


@attack("request-template", "2 clients sending chat_template: the issue's nested loop and {{ 'x' * 300000000 }} "
        "(400 unless the server runs --trust-request-chat-template; then killed in the sandbox: a 400 on its limits)")
def request_template(run: AttackRun) -> None:
    loop = "{% for a in range(99999) %}{% for b in range(99999) %}{{ a }}{% endfor %}{% endfor %}"
    templates = {"loop": loop, "huge": "{{ 'x' * 300000000 }}"}

    run.side_by_side(*(_repeating(run, label, _CHAT, {"messages": _HI, "max_tokens": 4, "chat_template": template})
                       for label, template in templates.items()))


@attack("big-grammar", "2 clients posting a 0.4 MB literal grammar (400: --max-grammar-bytes) and a 100 KB one "
        "(accepted: its masks must not stretch the bystander's steps)")
def big_grammar(run: AttackRun) -> None:
    huge = {"prompt": "a", "max_tokens": 32, "structured_outputs": {"grammar": 'start: "' + "ab" * 200_000 + '"'}}
    big = {"prompt": "a", "max_tokens": 32, "structured_outputs": {"grammar": 'start: "' + "ab" * 50_000 + '"'}}
    bodies = [json.dumps(huge).encode(), json.dumps(big).encode()]

    run.side_by_side(_repeating(run, "0.4MB", "/v1/completions", bodies[0]),
                     _repeating(run, "100KB", "/v1/completions", bodies[1]))


@attack("many-grammars", "4 clients posting distinct 20 KB json schemas, each compiled once "
        "(the grammar cache is bounded by --grammar-cache-bytes: RSS settles)")
def many_grammars(run: AttackRun) -> None:
    counter = iter(range(10**9))
    lock = threading.Lock()

    def loop() -> None:
        with httpx.Client(timeout=120) as client:
            while run.going():
                time.sleep(run.pause)
                with lock:
                    n = next(counter)
                props = {f"f{n}_{i}": {"type": "string", "maxLength": 8} for i in range(600)}
                schema = {"type": "object", "properties": props, "required": [f"f{n}_0"]}
                body = {"prompt": "a", "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema":
                        {"name": f"s{n}", "schema": schema}}}
                run.record(run.post("/v1/completions", body, client))

    run.in_threads(4, loop)


@attack("slow-compile", "1 client posting a 100,000-item choice (400: --max-grammar-bytes / the compile timeout) "
        "while another posts cheap regexes that must not wait behind it")
def slow_compile(run: AttackRun) -> None:
    choice = {"prompt": "a", "max_tokens": 4, "structured_outputs": {"choice": [f"w{i}" for i in range(100_000)]}}
    cheap = {"prompt": "a", "max_tokens": 4, "structured_outputs": {"regex": "[ab]{1,4}"}}
    waits: list[float] = []

    def light() -> None:
        while run.going():
            time.sleep(run.pause)
            started = time.monotonic()
            _labelled(run, "regex", "/v1/completions", cheap)
            waits.append(time.monotonic() - started)

    run.side_by_side(_repeating(run, "choice", "/v1/completions", choice), light)
    if waits:
        run.record(f"regex max {max(waits):.2f}s")


def _deep(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


@attack("tool-text", "the model is random, so tools force the shape: a named tool with a self-nesting schema "
        "(streamed and not, through the hermes parser), and history tool calls with 1,000- and 100,000-deep or "
        "invalid arguments (400, never 500)")
def tool_text(run: AttackRun) -> None:
    nest = {"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}, {"$ref": "#"}]}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": nest}}]
    forced = {"messages": _HI, "max_tokens": 48, "tools": tools, "ignore_eos": True,
              "tool_choice": {"type": "function", "function": {"name": "f"}}}

    def history(arguments: str) -> dict:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return {"messages": [*_HI, {"role": "assistant", "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 4, "tools": tools}

    bodies = [("forced", forced), ("forced-stream", {**forced, "stream": True}),
              ("history-1000", history(_deep(1000))), ("history-100000", history(_deep(100_000))),
              ("history-invalid", history('{"city": "Par'))]

    def loop() -> None:
        with httpx.Client(timeout=120) as client:
            turn = 0
            while run.going():
                time.sleep(run.pause)
                label, body = bodies[turn % len(bodies)]
                _labelled(run, label, _CHAT, body, client)
                turn += 1

    run.in_threads(2, loop)


@attack("priority", "a flood of priority 10 then priority -1000 requests (the server runs --scheduling-policy "
        "priority), and priorities out of range: -10**4000 and 10**30 (400)")
def priority(run: AttackRun) -> None:
    half = run.until - (run.until - time.monotonic()) / 2

    def loop() -> None:
        with httpx.Client(timeout=120) as client:
            while run.going():
                time.sleep(run.pause)
                level = 10 if time.monotonic() < half else -1000
                _labelled(run, f"p{level}", "/v1/completions",
                          {"prompt": "a", "max_tokens": 16, "ignore_eos": True, "priority": level}, client)

    def out_of_range() -> None:
        for label, raw in (("p-10**4000", b'{"prompt": "a", "priority": -' + b"9" * 4000 + b"}"),
                           ("p10**30", b'{"prompt": "a", "priority": 1' + b"0" * 30 + b"}")):
            _labelled(run, label, "/v1/completions", raw)

    run.in_threads(1, out_of_range)
    run.in_threads(4, loop)
