"""Telemetry never destroys what is not ours and never floods the log.

A socket path is cleared only when it is provably a stale socket of a pagedkv
engine; a trace file is replaced only once the run has started; a failing
accept backs off and warns once per period; clients are capped.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from repo_paths import ROOT

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.errors import ConfigError
from pagedkv.plugins.telemetry_address import parse_address
from pagedkv.plugins.telemetry_server import TelemetryServer


def _server(path: Path, **kwargs) -> TelemetryServer:
    return TelemetryServer(parse_address(f"unix:{path}"), lambda: [], lambda: [], lambda: b"", **kwargs)


def _engine(tiny_llama, **config) -> Engine:
    return Engine(EngineConfig(device="cpu", num_blocks=16, block_size=4, **config), model=tiny_llama)


# --- the socket path --------------------------------------------------------------------------------------------


def test_a_live_datagram_socket_of_another_program_is_never_removed(tmp_path):
    path = tmp_path / "log.sock"
    other = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # like /dev/log: refuses stream connections
    other.bind(str(path))
    try:
        with pytest.raises(ConfigError, match="in use by another program"):
            _server(path)
        assert path.is_socket()
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        probe.sendto(b"ping", str(path))  # the same socket still receives
        probe.close()
        assert other.recv(16) == b"ping"
    finally:
        other.close()


def test_a_dead_socket_that_is_not_ours_is_left_alone(tmp_path):
    path = tmp_path / "other.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()  # refuses every connection now, but nothing says a pagedkv engine left it
    inode = path.lstat().st_ino
    with pytest.raises(ConfigError, match="remove it yourself"):
        _server(path)
    assert path.lstat().st_ino == inode


def test_a_regular_file_at_the_socket_path_is_left_alone(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("precious")
    with pytest.raises(ConfigError, match="not a socket"):
        _server(path)
    assert path.read_text() == "precious"


def test_a_second_engine_on_the_same_path_is_refused_and_the_first_keeps_serving(tmp_path):
    path = tmp_path / "t.sock"
    first = _server(path)
    try:
        with pytest.raises(ConfigError, match="in use by another engine"):
            _server(path)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(path))
        client.close()
    finally:
        first.close()
    assert not path.exists() and not Path(f"{path}.lock").exists()


def test_a_stale_socket_left_by_a_killed_engine_is_reclaimed(tmp_path):
    path = tmp_path / "t.sock"
    code = textwrap.dedent(f"""
        import os
        from pagedkv.plugins.telemetry_address import parse_address
        from pagedkv.plugins.telemetry_server import TelemetryServer
        TelemetryServer(parse_address("unix:{path}"), lambda: [], lambda: [], lambda: b"")
        os._exit(0)  # dies without cleaning up, like kill -9
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)
    assert path.is_socket() and Path(f"{path}.lock").exists()
    server = _server(path)
    try:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(path))
        client.close()
    finally:
        server.close()


def test_a_stale_marker_does_not_cover_a_different_socket_at_the_path(tmp_path):
    path = tmp_path / "t.sock"
    server = _server(path)
    lock_text = Path(f"{path}.lock").read_bytes()
    server.close()
    Path(f"{path}.lock").write_bytes(lock_text)  # an old marker, then someone else's socket appears there
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()
    with pytest.raises(ConfigError, match="remove it yourself"):
        _server(path)
    assert path.is_socket()


# --- the trace file ---------------------------------------------------------------------------------------------


def test_a_failing_telemetry_setup_leaves_the_existing_trace_untouched(tiny_llama, tmp_path):
    trace = tmp_path / "run.ndjson"
    trace.write_text("the user's precious file\n")
    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match="cannot listen"):
            _engine(tiny_llama, telemetry=f"tcp:127.0.0.1:{port}", trace=str(trace))
    finally:
        busy.close()
    assert trace.read_text() == "the user's precious file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ndjson"]  # no temporary file left behind


def test_a_trace_replaces_the_old_file_once_the_engine_has_started(tiny_llama, tmp_path):
    from pagedkv.plugins.telemetry import close

    trace = tmp_path / "run.ndjson"
    trace.write_text("old\n")
    os.chmod(trace, 0o640)
    engine = _engine(tiny_llama, trace=str(trace))
    assert trace.read_bytes().startswith(b'{"v":')  # in place as soon as the engine runs (a live `tail -f` works)
    engine.add_request([1, 2, 3])
    while engine.has_unfinished():
        engine.step()
    close(engine)
    assert b'"type":"end"' in trace.read_bytes().splitlines()[-1]
    assert trace.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ndjson"]


@pytest.mark.parametrize("case", ["directory", "missing folder"])
def test_a_bad_trace_path_is_refused_before_the_model(tmp_path, case):
    path = tmp_path if case == "directory" else tmp_path / "nope" / "x.ndjson"
    with pytest.raises(ConfigError, match="trace"):
        Engine(EngineConfig(device="cpu", num_blocks=16, trace=str(path), model=str(tmp_path / "no-model")))


# --- the server under pressure ----------------------------------------------------------------------------------


def test_clients_beyond_the_cap_are_refused_and_logged_once(tmp_path, caplog):
    path = tmp_path / "t.sock"
    server = _server(path, max_clients=2)
    clients = []
    try:
        for _ in range(5):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(str(path))
            clients.append(c)
        deadline = time.monotonic() + 10
        while server.total_refused < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(server.clients) == 2 and server.total_refused == 3
        for c in clients[2:]:
            c.settimeout(5)
            assert c.recv(16) == b""  # told by a closed connection, at once
    finally:
        for c in clients:
            c.close()
        server.close()
    warnings = [r for r in caplog.records if "refused a client" in r.getMessage()]
    assert len(warnings) == 1 and "max_clients" in warnings[0].getMessage()


def test_accept_failing_with_too_many_open_files_backs_off_instead_of_spinning(tmp_path):
    path = tmp_path / "t.sock"
    code = textwrap.dedent(f"""
        import logging, resource, socket, time
        from pagedkv.plugins.telemetry_address import parse_address
        from pagedkv.plugins.telemetry_server import TelemetryServer

        records = []
        class Count(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
        logging.getLogger("pagedkv.telemetry").addHandler(Count())
        server = TelemetryServer(parse_address("unix:{path}"), lambda: [], lambda: [], lambda: b"",
                                 max_clients=1000, warn_period_s=10.0)
        pending = []
        for _ in range(8):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            pending.append(c)
        import os
        used = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (used, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        for c in pending:
            c.connect("{path}")  # queued in the listen backlog; accept() now fails with EMFILE
        time.sleep(2.0)
        print(len(records), server.accept_failures)
        print(records[0] if records else "")
        for c in pending:
            c.close()
        server.close()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, cwd=ROOT, text=True)
    assert proc.returncode == 0, proc.stderr
    counts, first = proc.stdout.splitlines()[:2]
    warnings, failures = map(int, counts.split())
    assert failures >= 1, proc.stdout
    assert warnings == 1, proc.stdout  # once per 10 s period, not ~1,700 a second
    assert failures < 100, proc.stdout  # backed off (at most ~20 polls/s in the first second), not a tight loop
    assert "Too many open files" in first
