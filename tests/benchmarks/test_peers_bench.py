"""benchmarks/serving/peers_bench.py without any peer installed: peers that are not installed are skipped with the
reason, ``--dtype`` and ``--gguf`` start the servers they name, batch 1 sends one chat at a time (checked against a
small fake streaming server), and the table's ratio column divides by the reference engine on the same weights."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from repo_paths import ROOT

BENCH = ROOT / "benchmarks" / "serving"
ROW = {"ttft_p50_s": 1.0, "ttft_p99_s": 2.0, "itl_p50_s": 0.05, "itl_p99_s": 0.1, "load": 1.5,
       "stream_tok_per_s_p50": 20.0}


@pytest.fixture
def peers_bench(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("peers_bench_under_test", BENCH / "peers_bench.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys.modules["peer_servers"], "PEERS", tmp_path / "no-peers")  # nothing installed there
    return module


def test_missing_peers_are_skipped_with_the_reason(peers_bench, capsys):
    assert peers_bench.main(["--peers", "vllm,vllm-eager,llamacpp", "--pagedkv", "", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("vllm", "vllm-eager", "llamacpp"):
        assert f"skipping {name}: not installed" in out
        assert f"| {name} | fp32 | 32 | skipped: not installed" in out
    assert "vllm_install.sh" in out and "llamacpp_install.sh" in out


def test_ratio_column_is_against_vllm_of_the_same_run_and_weights(peers_bench):
    Server = peers_bench.Server
    servers = [Server("vllm", [], {}, engine="vllm"), Server("vllm-bf16", [], {}, engine="vllm", weights="bf16"),
               Server("pagedkv-auto", [], {}, engine="pagedkv"),
               Server("pagedkv-auto-bf16", [], {}, engine="pagedkv", weights="bf16"),
               Server("llamacpp", [], {}, missing="not installed (x)", engine="llamacpp")]
    rows = [{"server": "vllm", "chats": 32, "output_tok_per_s": 90.0, **ROW},
            {"server": "vllm", "chats": 32, "output_tok_per_s": 100.0, **ROW},
            {"server": "vllm-bf16", "chats": 32, "output_tok_per_s": 200.0, **ROW},
            {"server": "pagedkv-auto", "chats": 32, "output_tok_per_s": 142.5, **ROW},
            {"server": "pagedkv-auto-bf16", "chats": 32, "output_tok_per_s": 100.0, **ROW}]
    table = peers_bench.table(rows, servers, [32])
    assert "| vllm | fp32 | 32 | 95.0 | 20.0 | 1.00 | 2.00 | 50 | 100 | 1.5/1.5 | 1.00 |" in table  # median of rounds
    assert "| pagedkv-auto | fp32 | 32 | 142.5 | 20.0 | 1.00 | 2.00 | 50 | 100 | 1.5 | 1.50 |" in table
    assert "| pagedkv-auto-bf16 | bf16 | 32 | 100.0 | 20.0 | 1.00 | 2.00 | 50 | 100 | 1.5 | 0.50 |" in table
    assert "| llamacpp | fp32 | 32 | skipped: not installed (x)" in table


def test_batch_1_row_is_filed_under_one_chat_though_it_sends_several(peers_bench):
    server = peers_bench.Server("pagedkv-cpu", [], {}, engine="pagedkv")
    summary = {"requests": 6, "ok": 6, "output_tok_per_s": 30.0, **ROW}
    table = peers_bench.table([peers_bench.row(server, 1, 1.5, summary)], [server], [1])
    assert "| pagedkv-cpu | fp32 | 1 | 30.0 | 20.0 | 1.00 | 2.00 | 50 | 100 | 1.5 | n/a (vllm fp32 not measured) |" \
        in table


def test_unknown_peer_is_one_clear_error(peers_bench):
    with pytest.raises(SystemExit, match="unknown peer 'sglang'"):
        peers_bench.main(["--peers", "sglang"])


def test_dtype_list_gives_vllm_and_pagedkv_one_server_per_dtype(peers_bench):
    args = peers_bench.parse(["--dtype", "fp32,bf16"])
    assert args.dtype == ["fp32", "bf16"]
    ps = sys.modules["peer_servers"]
    vllm = ps.peer_servers(["vllm"], 8310, 2, args.dtype)
    assert [(s.label, s.env["DTYPE"], s.weights) for s in vllm] == [("vllm", "float32", "fp32"),
                                                                    ("vllm-bf16", "bfloat16", "bf16")]
    mine = ps.pagedkv_servers(["cpu"], 8310, 2, [1], args.dtype)
    assert [s.label for s in mine] == ["pagedkv-cpu", "pagedkv-cpu-bf16"]
    assert mine[1].command[-2:] == ["--dtype", "bfloat16"]


def test_bad_dtype_is_a_one_line_usage_error(peers_bench, capsys):
    with pytest.raises(SystemExit) as stopped:
        peers_bench.parse(["--dtype", "fp32,int3"])
    assert stopped.value.code == 2
    assert "--dtype: int3 is not one of fp32, bf16" in capsys.readouterr().err


def test_gguf_serves_the_same_file_in_llamacpp_and_pagedkv_quantized(peers_bench, tmp_path):
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    args = peers_bench.parse(["--gguf", str(gguf), "--dtype", "fp32,bf16"])
    assert args.reference == "llamacpp"
    ps = sys.modules["peer_servers"]
    (llama,) = ps.peer_servers(["llamacpp"], 8310, 2, args.dtype, args.gguf, slots=64)
    assert (llama.label, llama.weights, llama.env["GGUF"], llama.env["NP"]) == ("llamacpp-Q4_1", "Q4_1", str(gguf),
                                                                               "64")
    (mine,) = ps.pagedkv_servers(["cpu"], 8310, 2, [1], args.dtype, args.gguf)
    assert (mine.label, mine.weights) == ("pagedkv-cpu-Q4_1", "Q4_1")
    assert mine.command[-4:] == ["--model", str(gguf), "--quantization", "gguf"]
    assert peers_bench.reference_of(mine, [llama, mine], "llamacpp") is llama


def test_gguf_weights_are_read_from_the_file_name(peers_bench, tmp_path):
    ps = sys.modules["peer_servers"]
    names = {"m-f32.gguf": "fp32", "m-q8_0.gguf": "Q8_0", "m.Q4_K_M.gguf": "Q4_K_M", "model.gguf": "gguf"}
    assert {n: ps.gguf_weights(tmp_path / n) for n in names} == names
    with pytest.raises(SystemExit):
        peers_bench.parse(["--gguf", str(tmp_path / "absent.gguf")])


class _Streamer(BaseHTTPRequestHandler):
    """A chat endpoint streaming four one-token chunks 50 ms apart; counts requests open at once."""

    open_now = 0
    most_open = 0
    lock = threading.Lock()

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._send(json.dumps({"data": [{"id": "fake"}]}).encode(), "application/json")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        cls = type(self)
        with cls.lock:
            cls.open_now += 1
            cls.most_open = max(cls.most_open, cls.open_now)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(4):
            time.sleep(0.05)
            self.wfile.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
            self.wfile.flush()
        self.wfile.write(b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n\ndata: [DONE]\n\n')
        with cls.lock:
            cls.open_now -= 1

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize("one_at_a_time", [True, False])
def test_batch_1_sends_each_chat_after_the_one_before_ends(peers_bench, one_at_a_time):
    serve_bench = sys.modules["serve_bench"]
    _Streamer.most_open = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Streamer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        requests = serve_bench.workload(4, float("inf"), 4, 4, 0)
        summary = asyncio.run(serve_bench.run_workload(url, requests, 30.0, one_at_a_time))
    finally:
        server.shutdown()
        server.server_close()
    assert summary["ok"] == 4 and (_Streamer.most_open == 1) == one_at_a_time  # at once: several open
    assert 5 < summary["stream_tok_per_s_p50"] < 25  # 3 tokens after the first in ~150 ms: ~20 tok/s
