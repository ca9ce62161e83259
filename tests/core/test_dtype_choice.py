"""``--dtype auto`` decides as vLLM does on CPU: bf16 for a bf16/fp16 checkpoint where the backend's bf16 path is
fast (by CPU features), fp32 otherwise; the engine and ``engine run`` resolve it before loading; explicit wins."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from engine_command import engine
from tiny_checkpoint import save_tiny

from pagedkv import Engine, EngineConfig, SamplingParams
from pagedkv.backends.cpu import build
from pagedkv.backends.cpu.dtype_features import cpu_dtype_features, features_for_cpu_flags
from pagedkv.backends.torch_ref import TorchBackend
from pagedkv.core.dtype_choice import DtypeFeatures, choose_dtype
from pagedkv.core.hookspecs import hookimpl

FAST = DtypeFeatures(True, "fake fast bf16")
SLOW = DtypeFeatures(False, "fake: no fast bf16")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# (checkpoint dtype, device, backend features, quantization) -> dtype auto runs
TABLE = [
    (BF16, "cpu", FAST, None, BF16),
    (F16, "cpu", FAST, None, BF16),  # no fast fp16 on CPU: vLLM runs fp16 checkpoints in bf16 there
    ("bfloat16", "cpu", FAST, None, BF16),  # config.json spells it
    (F32, "cpu", FAST, None, F32),
    (BF16, "cpu", SLOW, None, F32),
    (F16, "cpu", SLOW, None, F32),
    (BF16, "cpu", None, None, F32),  # a backend that declares nothing has no fast bf16 path
    (None, "cpu", FAST, None, F32),  # the checkpoint names no dtype
    ("float64", "cpu", FAST, None, F32),
    (BF16, "cpu", FAST, "gguf", F32),  # GGUF blocks: fp32 activations
    (None, "cpu", FAST, "gguf", F32),
    (BF16, "cpu", FAST, "int8", F32),  # blocks made at load: the same kernels, fp32 activations
    (BF16, "cpu", FAST, "int4", F32),
    (F16, "cuda", None, None, F16),  # CUDA keeps the checkpoint's
    (BF16, "cuda:0", None, None, BF16),
]


@pytest.mark.parametrize(("checkpoint", "device", "features", "quantization", "expected"), TABLE)
def test_auto_dtype_decision_table(checkpoint, device, features, quantization, expected):
    choice = choose_dtype(checkpoint, device, features, quantization)
    assert choice.dtype == expected
    assert choice.why and str(expected).replace("torch.", "") in choice.log_line()


AVX512 = "fma avx avx2 bmi1 bmi2 f16c movbe abm xsave avx512f avx512bw avx512cd avx512dq avx512vl"
CPU_FLAGS = [  # /proc/cpuinfo flags -> whether the cpu backend's bf16 path is fast there
    (AVX512 + " avx512_bf16 avx512_vnni", True),  # Zen 4/5, Sapphire Rapids: vdpbf16ps
    (AVX512, True),  # Skylake-X .. Ice Lake: bf16 widened in registers, half the weight bytes
    ("fma avx avx2 bmi1 bmi2 f16c movbe abm xsave", False),  # AVX2 only
    ("sse4_2 popcnt", False),  # the generic build
]


@pytest.mark.skipif(not build.is_x86(), reason="the builds are chosen by x86 feature flags")
@pytest.mark.parametrize(("flags", "fast"), CPU_FLAGS)
def test_cpu_backend_fast_bf16_comes_from_the_cpu_features(flags, fast, monkeypatch):
    monkeypatch.delenv("PAGEDKV_CPU_ISA", raising=False)
    assert features_for_cpu_flags(flags).fast_bf16 is fast


def test_a_build_whose_bf16_linears_do_not_run_through_the_kernel_is_not_fast():
    assert cpu_dtype_features("avx512-bf16", bf16_kernel=True).fast_bf16
    assert not cpu_dtype_features("avx512-bf16", bf16_kernel=False).fast_bf16  # e.g. $PAGEDKV_CPU_ROUTES=torch
    assert not cpu_dtype_features(None, bf16_kernel=True).fast_bf16  # a library bound by hand


class _FeaturedBackend(TorchBackend):
    def __init__(self, features: DtypeFeatures) -> None:
        super().__init__("cpu")
        self.dtype_features = features


class _Registers:
    def __init__(self, features: DtypeFeatures) -> None:
        self.features = features

    @hookimpl
    def pagedkv_register_backends(self, register):
        register("featured", lambda config: _FeaturedBackend(self.features), "a torch backend with fake features")


@pytest.mark.parametrize(("features", "expected"), [(FAST, BF16), (SLOW, F32)])
def test_the_engine_resolves_auto_from_its_backends_features(features, expected, caplog):
    model = _tiny_bf16()
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        eng = Engine(EngineConfig(device="cpu", num_blocks=16, block_size=4, backend="featured", dtype="auto"),
                     model=model, plugins=(_Registers(features),))
    assert eng.config.dtype == expected and eng.model.dtype == expected
    lines = [r.getMessage() for r in caplog.records if "--dtype auto" in r.getMessage()]
    assert len(lines) == 1 and features.why in lines[0]


def test_an_explicit_dtype_wins_over_auto():
    eng = Engine(EngineConfig(device="cpu", num_blocks=16, block_size=4, backend="featured", dtype="float32"),
                 model=_tiny_bf16(), plugins=(_Registers(FAST),))
    assert eng.config.dtype == F32 and eng.model.dtype == F32


def _tiny_bf16():
    from pagedkv.testing import tiny_llama

    return tiny_llama().to(torch.bfloat16)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("bf16"), dtype=torch.bfloat16)


def _run_dtype(path, *extra: str) -> str:
    proc = engine("run", "--model", str(path), "--device", "cpu", "--num-blocks", "64", "--block-size", "4",
                  "--threads", "1", "--prompt", "hi", "--max-tokens", "2", "--json", *extra)
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)["capacity"]["dtype"]


def test_engine_run_resolves_auto_by_default(bf16_checkpoint):
    from pagedkv.backends.cpu.backend import CpuBackend

    try:
        fast = CpuBackend().dtype_features.fast_bf16
    except build.BuildError:  # no compiler: the plugin falls back to the torch backend, which declares nothing
        fast = False
    assert _run_dtype(bf16_checkpoint) == ("bfloat16" if fast else "float32")  # the cpu backend, this CPU
    assert _run_dtype(bf16_checkpoint, "--backend", "torch") == "float32"  # declares no fast bf16 path
    assert _run_dtype(bf16_checkpoint, "--dtype", "bfloat16", "--backend", "torch") == "bfloat16"


def test_a_gguf_model_runs_fp32_activations_under_auto_even_where_bf16_is_fast(tmp_path):
    pytest.importorskip("gguf")
    from tiny_gguf import save_tiny_gguf

    gguf_dir, _ = save_tiny_gguf(tmp_path, "Q8_0")
    config = json.loads((gguf_dir / "config.json").read_text())
    (gguf_dir / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    eng = Engine(EngineConfig(model=str(gguf_dir), quantization="gguf", device="cpu", num_blocks=16, block_size=4,
                              backend="featured", dtype="auto"), plugins=(_Registers(FAST),))
    assert eng.config.dtype == F32
    rid = eng.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_unfinished():
        eng.step(stream=False)
    assert rid and eng.pool.num_available == eng.num_blocks


def test_engine_serve_resolves_auto_and_logs_why(bf16_checkpoint):
    import signal
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([str(Path(sys.executable).with_name("engine")), "serve", "--model", str(bf16_checkpoint),
                             "--port", str(port), "--device", "cpu", "--num-blocks", "64", "--block-size", "4",
                             "--backend", "torch", "--log-level", "info"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "engine serve did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    lines = [line for line in stderr.splitlines() if "--dtype auto" in line]
    assert len(lines) == 1 and "runs float32" in lines[0] and "bfloat16 checkpoint" in lines[0], stderr
