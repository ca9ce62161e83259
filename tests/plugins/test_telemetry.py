"""The telemetry plugin: address rule, wire format, trace replay, socket streaming."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest
from repo_paths import ROOT

from conftest import random_prompts
from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.telemetry_protocol import PROTOCOL_VERSION, ProtocolError, decode
from pagedkv.core.trace import TraceError, read_trace
from pagedkv.monitor.client import StreamClient
from pagedkv.monitor.state import MonitorState
from pagedkv.monitor.trace import replay
from pagedkv.plugins import telemetry
from pagedkv.plugins.telemetry_address import TelemetryAddressError, parse_address

# --- the address rule --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("unix:/tmp/x.sock", "unix:/tmp/x.sock"),
        ("tcp:127.0.0.1:9000", "tcp:127.0.0.1:9000"),
        ("tcp:127.3.2.1:1", "tcp:127.3.2.1:1"),
        ("tcp:localhost:9000", "tcp:127.0.0.1:9000"),
        ("TCP:LOCALHOST:80", "tcp:127.0.0.1:80"),
        ("tcp:[::1]:9000", "tcp:[::1]:9000"),
        ("tcp:::1:9000", "tcp:[::1]:9000"),
        ("tcp:127.0.0.1:0", "tcp:127.0.0.1:0"),
    ],
)
def test_loopback_and_unix_addresses_are_accepted(text, expected):
    assert str(parse_address(text)) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("tcp:0.0.0.0:9000", "not a loopback"),
        ("tcp:10.1.2.3:9000", "not a loopback"),
        ("tcp:8.8.8.8:53", "not a loopback"),
        ("tcp:[2001:db8::1]:9000", "not a loopback"),
        ("tcp:[::]:9000", "not a loopback"),
        ("tcp:example.com:9000", "not an IP literal"),
        ("tcp:localhost.evil.com:9000", "not an IP literal"),
        ("tcp:127.1:9000", "not an IP literal"),
        ("tcp:127.0.0.1", "needs a host and a port"),
        ("tcp:127.0.0.1:http", "not a number"),
        ("tcp:127.0.0.1:70000", "out of range"),
        ("udp:127.0.0.1:9000", "scheme 'udp' is not allowed"),
        ("http://127.0.0.1:9000", "scheme 'http' is not allowed"),
        ("127.0.0.1:9000", "scheme '127.0.0.1' is not allowed"),
        ("/tmp/x.sock", "no scheme"),
        ("unix:", "empty socket path"),
        ("unix:@abstract", "abstract"),
        ("", "empty"),
    ],
)
def test_other_addresses_are_refused_without_touching_the_network(monkeypatch, text, reason):
    def no_network(*args, **kwargs):
        raise AssertionError("the address rule must not create sockets or look names up")

    for name in ("socket", "getaddrinfo", "gethostbyname", "create_connection"):
        monkeypatch.setattr(socket, name, no_network)
    with pytest.raises(TelemetryAddressError, match=reason):
        parse_address(text)


def test_engine_refuses_a_remote_address_before_loading_anything(monkeypatch):
    monkeypatch.setattr(socket, "socket", lambda *a, **k: pytest.fail("a socket was created"))
    config = EngineConfig(device="cpu", model="/nonexistent/model", telemetry="tcp:192.168.1.10:7000")
    with pytest.raises(TelemetryAddressError, match="not a loopback"):
        Engine(config)


def test_cli_refuses_a_remote_address(capsys):
    from pagedkv.cli.main import main

    assert main(["run", "--model", "/nonexistent", "--telemetry", "tcp:example.com:80"]) == 2
    assert "not an IP literal" in capsys.readouterr().err
    assert main(["monitor", "--connect", "tcp:1.2.3.4:80"]) == 2
    assert "not a loopback" in capsys.readouterr().err


# --- recording and replaying ---------------------------------------------------------------------------


class StepRecorder:
    """A test plugin: the engine's block map after every step."""

    def __init__(self):
        self.maps = []
        self.tables = []

    @telemetry.hookimpl
    def pagedkv_on_step_events(self, events):
        self.maps.append(telemetry.engine_block_map(self.engine))
        self.tables.append(telemetry.engine_request_tables(self.engine))

    @telemetry.hookimpl
    def pagedkv_engine_started(self, engine):
        self.engine = engine


def run_engine(model, tmp_path, *, num_blocks=20, keyframe_steps=5, abort_at=None, stop_after=None, **config):
    recorder = StepRecorder()
    config.setdefault("trace", str(tmp_path / "run.ndjson"))
    options = {"telemetry": {"keyframe_steps": keyframe_steps, "keyframe_s": 1e9, "heartbeat_s": 0.2}}
    engine = Engine(
        EngineConfig(device="cpu", num_blocks=num_blocks, block_size=4, max_num_batched_tokens=32,
                     plugin_options=options, **config),
        model=model, plugins=(recorder,),
    )
    for prompt in random_prompts([6, 11, 17, 9, 14, 5], seed=3):
        engine.add_request(prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == abort_at:
            engine.abort("2")
        if steps == stop_after:
            break
    return engine, recorder


@pytest.fixture(scope="module")
def recorded(tiny_llama, tmp_path_factory):
    """One run with preemptions and an abort, stopped while requests still hold blocks."""
    tmp = tmp_path_factory.mktemp("trace")
    engine, recorder = run_engine(tiny_llama, tmp, keyframe_steps=5, abort_at=4, stop_after=14)
    assert engine.stats.preemptions > 0, "the workload should preempt"
    before_close = telemetry.engine_block_map(engine)
    telemetry.close(engine)
    return engine, recorder, tmp / "run.ndjson", before_close


def test_trace_lines_are_versioned_ndjson_with_keyframes(recorded):
    _, recorder, path, _ = recorded
    lines = path.read_text().splitlines()
    msgs = [json.loads(line) for line in lines]
    assert all(m["v"] == PROTOCOL_VERSION and isinstance(m["seq"], int) for m in msgs)
    assert [m["type"] for m in msgs[:2]] == ["hello", "snapshot"]
    assert msgs[0]["num_blocks"] == 20 and msgs[0]["block_size"] == 4
    assert msgs[-1]["type"] == "end"
    deltas = [m for m in msgs if m["type"] == "delta"]
    assert [d["seq"] for d in deltas] == list(range(1, len(recorder.maps) + 1))
    kinds = {ev[0] for d in deltas for ev in d["events"]}
    assert {"block_alloc", "block_free", "request_add", "request_preempt", "request_finish"} <= kinds
    assert [m["seq"] for m in msgs if m["type"] == "snapshot"] == [0, 5, 10, 15]  # keyframes, and the final one


def test_deltas_alone_reproduce_the_engine_block_map_after_every_step(recorded):
    _, recorder, path, _ = recorded
    trace = read_trace(path)
    state = MonitorState()
    checked = 0
    for msg in trace.messages:
        if msg["type"] == "snapshot" and msg["seq"] > 0:
            continue  # no keyframes: the deltas must be exact on their own
        state.apply(msg)
        if msg["type"] == "delta":
            assert state.synced
            assert state.block_map() == recorder.maps[msg["seq"] - 1], f"step {msg['step']}"
            assert state.request_tables() == recorder.tables[msg["seq"] - 1], f"step {msg['step']}"
            checked += 1
    assert checked == len(recorder.maps) == 14


def test_replaying_the_trace_reproduces_the_final_block_states_exactly(recorded):
    engine, _, path, before_close = recorded
    state = replay(path)
    assert state.block_map() == telemetry.engine_block_map(engine) == before_close
    assert state.request_tables() == telemetry.engine_request_tables(engine)
    assert any(s != "free" for s, _, _ in state.block_map()), "stopped mid-run, some blocks are held"
    assert state.ended and state.synced and state.gaps == 0


def test_a_dropped_delta_is_healed_by_the_next_snapshot(recorded):
    _, recorder, path, _ = recorded
    msgs = read_trace(path).messages
    dropped = next(i for i, m in enumerate(msgs) if m["type"] == "delta" and m["seq"] == 7)
    del msgs[dropped]
    state = MonitorState()
    for msg in msgs:
        state.apply(msg)
        if msg["type"] == "delta" and msg["seq"] in (8, 9):
            assert not state.synced  # the gap is noticed; later deltas are not applied to a wrong state
        if msg["seq"] == 10 and msg["type"] == "snapshot":
            assert state.synced and state.resyncs == 1
            assert state.block_map() == recorder.maps[9]
    assert state.gaps == 1
    assert state.synced and state.block_map() == recorder.maps[-1]


def test_a_truncated_trace_names_the_line(recorded, tmp_path):
    _, _, path, _ = recorded
    data = path.read_bytes()
    cut = tmp_path / "cut.ndjson"
    cut.write_bytes(data[: len(data) - 40])
    nlines = cut.read_bytes().count(b"\n") + 1
    with pytest.raises(TraceError, match=rf"cut.ndjson line {nlines}: not valid JSON.*truncated"):
        replay(cut)
    trace = read_trace(cut, strict=False)
    assert trace.error is not None and len(trace.messages) == nlines - 1


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("not json at all", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"seq": 1, "type": "delta"}', "protocol version"),
        ('{"v": 99, "seq": 1, "type": "delta"}', "newer than this reader"),
        ('{"v": 1, "seq": 1, "type": "bogus"}', "unknown message type"),
        ('{"v": 1, "seq": -1, "type": "heartbeat"}', "'seq' must be an integer"),
        ('{"v": 1, "seq": 1, "type": "delta", "step": 1, "events": [["block_free"]]}', "must be \\[kind"),
        ('{"v": 1, "seq": 1, "type": "snapshot", "step": 1, "refs": [0], "kept": [5], "requests": []}',
         "out of range"),
    ],
)
def test_a_malformed_line_names_the_line(recorded, tmp_path, line, reason):
    _, _, path, _ = recorded
    lines = path.read_text().splitlines()
    lines.insert(3, line)
    bad = tmp_path / "bad.ndjson"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=f"bad.ndjson line 4: .*{reason}"):
        replay(bad)


def test_an_event_that_contradicts_the_state_names_the_line(recorded, tmp_path):
    _, _, path, _ = recorded
    lines = path.read_text().splitlines()
    msg = json.loads(lines[2])
    msg["events"] = [["block_free", {"block": 999}]]
    lines[2] = json.dumps(msg)
    bad = tmp_path / "bad.ndjson"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match="bad.ndjson line 3: event block_free .*out of range"):
        replay(bad)


def test_unknown_event_kinds_are_skipped_and_later_plugins_events_are_understood():
    state = MonitorState()
    state.apply(decode('{"v":1,"seq":0,"type":"hello","num_blocks":4,"block_size":2,"num_cpu_blocks":4}'))
    state.apply(decode('{"v":1,"seq":0,"type":"snapshot","step":0,"refs":[0,0,0,0],"kept":[],"requests":[]}'))
    events = [
        ["request_add", {"request": "a", "prompt_tokens": 3, "n": 1}],
        ["block_alloc", {"block": 0, "owner": "a"}],
        ["block_alloc", {"block": 1, "owner": "a"}],
        ["block_share", {"block": 1, "refs": 2, "owner": "b"}],
        ["block_cow", {"src": 1, "dst": 2, "owner": "a"}],
        ["block_alloc", {"block": 2, "owner": "a"}],
        ["block_unshare", {"block": 1, "refs": 1, "owner": "a"}],
        ["block_swap_out", {"block": 0, "cpu_block": 3, "owner": "a"}],
        ["block_free", {"block": 0}],
        ["block_teleport", {"block": 0}],
    ]
    state.apply({"v": 1, "seq": 1, "type": "delta", "step": 1, "events": events, "stats": {}})
    assert state.requests["a"].blocks == [2] and state.requests["a"].cpu_blocks == [3]
    assert state.requests["a"].state == "swapped"
    assert state.block_map() == [("free", 0, ()), ("used", 1, ("b",)), ("used", 1, ("a",)), ("free", 0, ())]
    assert state.unknown_events == {"block_teleport": 1}
    swap_in = [["block_swap_in", {"block": 3, "cpu_block": 3, "owner": "a"}]]
    state.apply({"v": 1, "seq": 2, "type": "delta", "step": 2, "events": swap_in, "stats": {}})
    assert state.cpu_holders == {} and state.requests["a"].blocks == [2, 3]


def test_fuzzed_traces_give_a_trace_error_or_a_state_never_a_crash(recorded, tmp_path):
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    _, _, path, _ = recorded
    original = path.read_bytes()[:4000]
    fuzz = tmp_path / "fuzz.ndjson"

    @hypothesis.settings(max_examples=60, deadline=None, database=None)
    @hypothesis.given(st.integers(0, len(original) - 1), st.binary(max_size=8), st.integers(0, 6))
    def check(pos, junk, cut):
        fuzz.write_bytes(original[:pos] + junk + original[pos + cut:])
        try:
            replay(fuzz)
        except TraceError:
            pass

    check()


# --- streaming over sockets -------------------------------------------------------------------------------


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_monitor_client_on_a_unix_socket_ends_with_the_engine_block_map(tiny_llama, tmp_path):
    sock_path = tmp_path / "t.sock"
    engine = Engine(
        EngineConfig(device="cpu", num_blocks=20, block_size=4, telemetry=f"unix:{sock_path}",
                     plugin_options={"telemetry": {"keyframe_steps": 4, "heartbeat_s": 0.1}}),
        model=tiny_llama,
    )
    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
    state, lock, statuses = MonitorState(), threading.Lock(), []

    def on_message(msg):
        with lock:
            state.apply(msg)

    client = StreamClient(f"unix:{sock_path}", on_message, lambda k, t: statuses.append(k)).start()
    assert _wait(lambda: state.synced)
    for prompt in random_prompts([6, 11, 17, 9, 14], seed=4):
        engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    steps = 0
    while engine.has_unfinished() and steps < 9:
        engine.step()
        steps += 1
    expected = telemetry.engine_block_map(engine)
    assert any(s != "free" for s, _, _ in expected)
    seq = telemetry.find(engine).seq
    assert _wait(lambda: state.seq == seq)
    with lock:
        assert state.block_map() == expected
        assert state.request_tables() == telemetry.engine_request_tables(engine)
        assert state.gaps == 0
    telemetry.close(engine)
    assert _wait(lambda: "disconnected" in statuses)
    client.stop()
    assert statuses[0] == "connected" and state.ended
    assert not sock_path.exists()


def test_a_slow_client_never_blocks_the_engine_and_resyncs(tiny_llama, tmp_path):
    engine = Engine(
        EngineConfig(device="cpu", num_blocks=20, block_size=4, telemetry="tcp:127.0.0.1:0",
                     plugin_options={"telemetry": {"keyframe_steps": 3, "queue_lines": 4, "heartbeat_s": 0.05,
                                                   "socket_sndbuf": 4096}}),
        model=tiny_llama,
    )
    tel = telemetry.find(engine)
    address = parse_address(tel.server.bound)
    assert address.host == "127.0.0.1" and address.port > 0
    slow = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    slow.connect((address.host, address.port))  # and never reads while the engine runs
    dead = socket.create_connection((address.host, address.port))
    assert _wait(lambda: tel.server.total_clients == 2)
    dead.close()
    assert _wait(lambda: len(tel.server.clients) == 1), "a hung-up client is forgotten"
    for prompt in random_prompts([30, 25, 28], seed=5):
        engine.add_request(prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert tel.server.total_drops > 0
    state = MonitorState()
    reader = slow.makefile("rb")
    expected = telemetry.engine_block_map(engine)
    slow.settimeout(10)
    for line in reader:
        state.apply(decode(line))
        if state.synced and state.seq == tel.seq:
            break
    assert state.block_map() == expected
    slow.close()
    telemetry.close(engine)


def test_core_does_not_import_textual(tmp_path):
    code = (
        "import sys; sys.path.insert(0, 'tests'); from conftest import _tiny_llama\n"
        "from pagedkv import Engine, EngineConfig, SamplingParams\n"
        "import pagedkv.cli.main, pagedkv.plugins.telemetry as t, pagedkv.monitor.state, pagedkv.monitor.client\n"
        f"e = Engine(EngineConfig(device='cpu', num_blocks=8, block_size=4, trace={str(tmp_path / 'x')!r}),"
        " model=_tiny_llama())\n"
        "e.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))\n"
        "while e.has_unfinished(): e.step()\n"
        "assert t.find(e) is not None, 'the telemetry entry point is registered'\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'textual'], 'textual was imported'\n"
    )
    root = str(ROOT)
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120)


def test_protocol_decode_rejects_garbage():
    with pytest.raises(ProtocolError, match="not UTF-8"):
        decode(b"\xff\xfe{")
    with pytest.raises(ProtocolError, match="empty line"):
        decode("   ")


class FullRecorder(StepRecorder):
    @telemetry.hookimpl
    def pagedkv_on_step_events(self, events):
        super().pagedkv_on_step_events(events)
        self.cpu_maps = getattr(self, "cpu_maps", [])
        self.cpu_maps.append(telemetry.engine_cpu_map(self.engine))


def test_prefix_cache_cow_and_swap_events_replay_exactly(tiny_llama, tmp_path):
    recorder = FullRecorder()
    engine = Engine(
        EngineConfig(device="cpu", num_blocks=16, block_size=4, max_num_batched_tokens=32, trace=str(tmp_path / "t"),
                     enable_prefix_caching=True, enable_copy_on_write=True, swap_space=64 * 1024,
                     plugin_options={"telemetry": {"keyframe_steps": 1000, "keyframe_s": 1e9}}),
        model=tiny_llama, plugins=(recorder,),
    )
    shared = random_prompts([9], seed=7)[0]
    for i, tail in enumerate(random_prompts([5, 6, 4], seed=8)):
        engine.add_request(shared + tail, SamplingParams(max_tokens=12, ignore_eos=True, n=2 if i == 0 else 1))
    while engine.has_unfinished() and len(recorder.maps) < 16:
        engine.step()
    telemetry.close(engine)
    trace = read_trace(tmp_path / "t")
    kinds = {ev[0] for m in trace.messages if m["type"] == "delta" for ev in m["events"]}
    state = MonitorState()
    for msg in trace.messages:
        if msg["type"] == "snapshot" and msg["seq"] > 0:
            continue
        state.apply(msg)
        if msg["type"] == "delta":
            i = msg["seq"] - 1
            assert state.block_map() == recorder.maps[i], f"step {msg['step']}"
            assert state.cpu_map() == recorder.cpu_maps[i], f"step {msg['step']}"
            assert {k: set(v) for k, v in state.request_tables().items()} == {
                k: set(v) for k, v in recorder.tables[i].items()}
    assert state.num_cpu_blocks > 0 and state.unknown_events == {}
    assert {"block_share", "block_keep", "block_cow", "block_swap_out", "block_swap_in", "request_fork"} <= kinds
