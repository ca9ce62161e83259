"""benchmarks/serving/peers_bench.py without any server: peers that are not installed are skipped with the reason,
and the table's ratio column is against vLLM CPU measured in the same run."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from repo_paths import ROOT

BENCH = ROOT / "benchmarks" / "serving"


@pytest.fixture
def peers_bench(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("peers_bench_under_test", BENCH / "peers_bench.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "PEERS", tmp_path / "no-peers")  # nothing installed there
    return module


def test_missing_peers_are_skipped_with_the_reason(peers_bench, capsys):
    assert peers_bench.main(["--peers", "vllm,vllm-eager,llamacpp", "--pagedkv", "", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("vllm", "vllm-eager", "llamacpp"):
        assert f"skipping {name}: not installed" in out
        assert f"| {name} | 32 | skipped: not installed" in out
    assert "vllm_install.sh" in out and "llamacpp_install.sh" in out


def test_ratio_column_is_against_vllm_of_the_same_run(peers_bench):
    servers = [peers_bench.Server("vllm", [], {}), peers_bench.Server("pagedkv-auto", [], {}),
               peers_bench.Server("llamacpp", [], {}, missing="not installed (x)")]
    row = {"ttft_p50_s": 1.0, "ttft_p99_s": 2.0, "itl_p50_s": 0.05, "itl_p99_s": 0.1, "load": 1.5}
    rows = [{"server": "vllm", "requests": 32, "output_tok_per_s": 90.0, **row},
            {"server": "vllm", "requests": 32, "output_tok_per_s": 100.0, **row},
            {"server": "pagedkv-auto", "requests": 32, "output_tok_per_s": 142.5, **row}]
    table = peers_bench.table(rows, servers, [32])
    assert "| vllm | 32 | 95.0 | 1.00 | 2.00 | 50 | 100 | 1.5/1.5 | 1.00 |" in table  # median of its rounds
    assert "| pagedkv-auto | 32 | 142.5 | 1.00 | 2.00 | 50 | 100 | 1.5 | 1.50 |" in table
    assert "| llamacpp | 32 | skipped: not installed (x)" in table


def test_unknown_peer_is_one_clear_error(peers_bench):
    with pytest.raises(SystemExit, match="unknown peer 'sglang'"):
        peers_bench.main(["--peers", "sglang"])

