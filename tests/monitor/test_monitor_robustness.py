"""The monitor against lines it cannot parse, a missing terminal and SIGTERM (issue 25)."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import socket
import subprocess
import threading
import time

import pytest
from engine_command import ENGINE, QUIET, assert_one_line_error, engine
from repo_paths import ROOT

from pagedkv.core.telemetry_protocol import ProtocolError, decode
from pagedkv.monitor.client import StreamClient

HELLO = {"v": 2, "seq": 0, "type": "hello", "t": 0, "num_blocks": 8, "block_size": 4}
HUGE = '{"v": 2, "seq": 1, "type": "heartbeat", "t": ' + "9" * 5000 + "}"


def test_a_line_with_a_5000_digit_integer_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="not valid JSON"):
        decode(HUGE)


def test_the_reader_thread_skips_and_counts_bad_lines_and_keeps_reading():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def feed() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(f"{HUGE}\n\xff\n{json.dumps(HELLO)}\n".encode("utf-8", "surrogateescape"))
            time.sleep(1.0)

    threading.Thread(target=feed, daemon=True).start()
    got, statuses = [], []
    client = StreamClient(f"tcp:127.0.0.1:{port}", got.append, lambda kind, text: statuses.append((kind, text)),
                          reconnect=False).start()
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    client.stop()
    server.close()
    assert [m["type"] for m in got] == ["hello"]
    assert client.skipped == 2
    errors = [text for kind, text in statuses if kind == "error"]
    assert len(errors) == 2 and "2 skipped so far" in errors[1]


def test_replay_and_simulate_on_a_trace_with_a_huge_integer_are_one_line(tmp_path):
    path = tmp_path / "huge.ndjson"
    path.write_text(json.dumps(HELLO) + "\n" + HUGE + "\n")
    assert_one_line_error(engine("simulate", "--workload", str(path)), "line 2")
    workload = tmp_path / "huge.jsonl"
    workload.write_text('{"prompt_len": ' + "9" * 5000 + "}\n")
    assert_one_line_error(engine("simulate", "--workload", str(workload)), "line 1")
    proc = engine("monitor", "--replay", str(path))
    assert_one_line_error(proc)


def test_without_a_terminal_the_monitor_says_so_in_one_line_and_exits_2():
    started = time.monotonic()
    proc = subprocess.run([*ENGINE, "monitor", "--connect", "unix:/nonexistent/dir/x.sock"], capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=60, cwd=ROOT, env={**os.environ, **QUIET})
    assert_one_line_error(proc, "terminal")
    assert time.monotonic() - started < 30


def test_in_a_terminal_sigterm_ends_the_monitor_promptly():
    pid, fd = pty.fork()
    if pid == 0:  # the child: the monitor, on a pseudo-terminal
        os.environ.update(QUIET)
        os.chdir(ROOT)
        os.execv(ENGINE[0], [*ENGINE, "monitor", "--connect", "unix:/nonexistent/dir/x.sock"])
    drained = threading.Event()

    def drain() -> None:  # a terminal that is never read fills up and blocks the app
        try:
            while os.read(fd, 65536):
                pass
        except OSError:
            pass
        drained.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        time.sleep(8)  # Textual is up and drawing the "waiting for the engine" banner
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the monitor exited on its own"
        os.kill(pid, signal.SIGTERM)
        started = time.monotonic()
        while time.monotonic() - started < 5:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the monitor was still running 5 s after SIGTERM")
    finally:
        _reap(pty_child=pid, fd=fd)


def test_in_a_terminal_q_quits_a_replay_with_status_0_and_no_traceback(tmp_path):
    """Quitting once ran into an import of a module that had moved (``pagedkv.core.interrupts``): exit 1."""
    trace = tmp_path / "t.ndjson"
    trace.write_text(json.dumps({**HELLO, "v": 3}) + "\n" + json.dumps(
        {"v": 3, "seq": 0, "type": "snapshot", "t": 0, "step": 0, "refs": [0] * 8, "kept": [], "requests": [],
         "stats": {}}) + "\n")
    pid, fd = pty.fork()
    if pid == 0:
        os.environ.update(QUIET)
        os.chdir(ROOT)
        os.execv(ENGINE[0], [*ENGINE, "monitor", "--replay", str(trace)])
    out = bytearray()
    try:
        started, sent = time.monotonic(), False
        while time.monotonic() - started < 60:
            if not sent and b"end of replay" in out:  # Textual is up and has drawn the banner
                os.write(fd, b"q")
                sent = True
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
        _, status = os.waitpid(pid, 0)
        assert sent, "the dashboard never drew its end-of-replay banner"
        assert b"Traceback" not in out, out[-2000:].decode(errors="replace")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        _reap(pty_child=pid, fd=fd)


def _reap(pty_child: int, fd: int) -> None:
    """Kill a ``pty.fork`` child that may still run (or be gone already) and close its terminal."""
    try:
        os.kill(pty_child, signal.SIGKILL)
        os.waitpid(pty_child, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    os.close(fd)
