"""Where the cpu backend runs each phase (``backends/cpu/routes.py``): forced by ``$PAGEDKV_CPU_ROUTES``, known by
features for the AVX2 and AVX-512 builds, otherwise measured with a margin, cached only when the machine was
quiet, and written so that engines starting together never collide. The measurement itself is replaced here
by fixed verdicts: no test depends on what this machine measures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from repo_paths import TESTS

from pagedkv.backends.cpu import build, routes
from pagedkv.backends.cpu.routes import KERNEL, TORCH, Measurement, Routes
from pagedkv.core.errors import ConfigError

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler: no cpu kernel")
EVERY_TORCH = Routes(decode=TORCH, prefill=TORCH, linear=TORCH)


def fixed(verdict: Routes, share: float = 1.0, asked: list | None = None):
    """A stand-in for routes.measure that returns ``verdict`` as measured with ``share`` of the cores."""
    def measure(lib, **kwargs):
        if asked is not None:
            asked.append(lib)
        return Measurement(verdict, {"linear 1 rows": {KERNEL: 2e-3, TORCH: 1e-3}}, share)
    return measure


@pytest.mark.parametrize(("text", "expected"), [
    (None, "auto"), ("", "auto"), ("auto", "auto"), ("measure", "measure"), (" Kernel ", Routes()),
    ("torch", EVERY_TORCH), ("linear=torch", Routes(linear=TORCH)),
    ("decode=torch, prefill=kernel,linear=torch", Routes(decode=TORCH, linear=TORCH)),
])
def test_the_environment_forces_routes(monkeypatch, text, expected):
    monkeypatch.delenv(routes.ENV, raising=False)
    assert routes.requested(text if text is not None else None) == expected


@pytest.mark.parametrize("text", ["fast", "linear=gpu", "attention=torch", "linear=torch,linear=kernel", "linear"])
def test_a_bad_route_setting_is_a_one_line_config_error(text):
    with pytest.raises(ConfigError, match=f"{routes.ENV}=") as err:
        routes.requested(text)
    assert "\n" not in str(err.value) and "decode, prefill, linear" in str(err.value)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_fast_builds_run_the_kernel_by_their_features(monkeypatch, tmp_path, isa):
    monkeypatch.setattr(routes, "measure", fixed(EVERY_TORCH, asked=(asked := [])))
    assert routes.routes_for(None, isa, tmp_path / f"{isa}.routes.json") == Routes()
    assert asked == [] and not any(tmp_path.iterdir())


def test_a_forced_route_wins_over_features_and_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(routes, "measure", fixed(Routes(), asked=(asked := [])))
    cache = tmp_path / "generic.routes.json"
    cache.write_text(json.dumps({"decode": "kernel", "prefill": "kernel", "linear": "kernel"}))
    assert routes.routes_for(None, "avx512", cache, EVERY_TORCH) == EVERY_TORCH
    assert routes.routes_for(None, "generic", cache, Routes(linear=TORCH)) == Routes(linear=TORCH)
    assert asked == []


def test_measure_mode_measures_even_a_fast_build_and_caches_a_quiet_verdict(monkeypatch, tmp_path):
    monkeypatch.setattr(routes, "measure", fixed(Routes(linear=TORCH), asked=(asked := [])))
    cache = tmp_path / "avx512.routes.json"
    assert routes.routes_for("lib", "avx512", cache, "measure") == Routes(linear=TORCH)
    assert asked == ["lib"]
    assert json.loads(cache.read_text()) == {"decode": "kernel", "prefill": "kernel", "linear": "torch"}


def test_other_builds_are_measured_once_and_cached(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(routes, "measure", fixed(Routes(prefill=TORCH), asked=(asked := [])))
    cache = tmp_path / "generic.routes.json"
    with caplog.at_level("INFO", logger="pagedkv"):
        assert routes.routes_for("lib", "generic", cache) == Routes(prefill=TORCH)
    assert any("prefill by torch" in r.getMessage() and "2.00 vs 1.00 ms" in r.getMessage() for r in caplog.records)
    assert routes.routes_for("lib", "generic", cache) == Routes(prefill=TORCH) and len(asked) == 1
    cache.write_text(json.dumps({"decode": "torch", "prefill": "kernel"}))  # (a cache from before the linear)
    assert routes.routes_for("lib", "generic", cache) == Routes(decode=TORCH)
    assert [p.name for p in tmp_path.iterdir()] == [cache.name], "no temporary file is left behind"


def test_a_verdict_measured_on_a_busy_machine_is_not_kept(monkeypatch, tmp_path, caplog):
    # the measurement is unreliable while another process holds a core: this start runs the kernel, nothing is
    # cached, and the next start measures again
    monkeypatch.setattr(routes, "measure", fixed(EVERY_TORCH, share=0.5, asked=(asked := [])))
    cache = tmp_path / "generic.routes.json"
    with caplog.at_level("INFO", logger="pagedkv"):
        assert routes.routes_for("lib", "generic", cache) == Routes()
    assert not cache.exists() and any("busy" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(routes, "measure", fixed(EVERY_TORCH, share=0.95, asked=asked))
    assert routes.routes_for("lib", "generic", cache) == EVERY_TORCH and len(asked) == 2
    assert cache.exists()


def test_unreadable_route_cache_is_measured_again(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(routes, "measure", fixed(Routes(decode=TORCH)))
    cache = tmp_path / "generic.routes.json"
    cache.write_text("{not json")
    assert routes.routes_for("lib", "generic", cache) == Routes(decode=TORCH)
    assert json.loads(cache.read_text())["decode"] == TORCH
    assert any("unreadable" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("cases", "verdict"), [
    ([{KERNEL: 1.0, TORCH: 1.0}], KERNEL),
    ([{KERNEL: 1.08, TORCH: 1.0}], KERNEL),  # inside the margin: a near tie keeps the kernel
    ([{KERNEL: 1.2, TORCH: 1.0}], TORCH),
    ([{KERNEL: 2.0, TORCH: 1.0}, {KERNEL: 1.0, TORCH: 2.0}], KERNEL),  # the cases weigh alike
    ([{KERNEL: 3.0, TORCH: 1.0}, {KERNEL: 1.0, TORCH: 1.1}], TORCH),
])
def test_torch_takes_a_phase_only_past_the_margin(cases, verdict):
    assert routes._pick(cases) == verdict


def test_measure_takes_the_phases_asked_for(monkeypatch):
    calls = []
    monkeypatch.setattr(routes, "_attention_cases", lambda lib: {
        "prefill": {KERNEL: lambda: calls.append("pk"), TORCH: lambda: (calls.append("pt"), time.sleep(0.02))},
        "decode": {KERNEL: lambda: time.sleep(0.02), TORCH: lambda: None}})
    monkeypatch.setattr(routes, "_linear_cases", lambda lib: {
        1: {KERNEL: lambda: None, TORCH: lambda: time.sleep(0.02)}})
    got = routes.measure(None, rounds=3, attention=True, linear=False)
    assert got.routes == Routes(decode=TORCH) and set(got.seconds) == {"prefill", "decode"}
    assert calls == ["pk", "pt"] * 4, "one warm-up call each, then the paths in turn each round"
    assert routes.measure(None, rounds=1, attention=False, linear=True).routes == Routes()
    assert routes.measure(None, attention=False, linear=False).routes == Routes()
    assert 0.0 <= got.cpu_share <= 1.0


def test_a_sleeping_measurement_reads_as_a_busy_machine(monkeypatch):
    # wall time that is not this process's CPU time (here: sleeping, as when descheduled) lowers the share
    monkeypatch.setattr(routes, "_attention_cases", lambda lib: {"decode": {KERNEL: lambda: time.sleep(0.05),
                                                                            TORCH: lambda: time.sleep(0.05)}})
    got = routes.measure(None, rounds=2, linear=False)
    assert got.cpu_share < routes.QUIET_SHARE and not got.quiet


@needs_compiler
def test_the_real_measurement_runs_every_case_on_the_plain_build():
    lib = build.load(build.variants()[-1])
    got = routes.measure(lib, rounds=1)
    assert set(got.seconds) == {"prefill", "decode", "linear 1 rows", "linear 16 rows", "linear 256 rows"}
    assert all(t[KERNEL] > 0 and t[TORCH] > 0 for t in got.seconds.values())
    assert {got.routes.decode, got.routes.prefill, got.routes.linear} <= {KERNEL, TORCH}


def test_concurrent_cache_writers_never_collide(tmp_path):
    # each writer renames a temporary file of its own; one shared name made a second writer's rename fail
    target, errors, barrier = tmp_path / "lib.routes.json", [], threading.Barrier(8)

    def write(i: int) -> None:
        barrier.wait()
        try:
            for _ in range(40):
                routes.write_atomically(target, json.dumps({"writer": i}))
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and json.loads(target.read_text())["writer"] in range(8)
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


TWO_ENGINES = """
import sys, torch
from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.sample.sampling_params import SamplingParams
sys.path.insert(0, sys.argv[2])
from conftest import drain
engine = Engine(EngineConfig(model=sys.argv[1], backend="cpu", device="cpu", dtype=torch.float32, num_blocks=32,
                             block_size=4))
rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
out, _ = drain(engine)
assert len(out[rid].outputs[0].token_ids) == 4 and engine.pool.num_used == 0
print("ran", engine.backend.routes)
"""


@needs_compiler
def test_two_engines_measuring_at_once_on_an_empty_route_cache_both_run(tmp_path):
    from tiny_checkpoint import save_tiny

    lib = build.load()
    model = save_tiny(tmp_path / "model")
    cache = tmp_path / "cache"
    target = cache / "cpu_attention" / build.library_path(lib.isa).name
    target.parent.mkdir(parents=True)
    target.write_bytes(build.library_path(lib.isa).read_bytes())  # the built library, but no route cache
    env = {**os.environ, "PAGEDKV_CACHE": str(cache), "PAGEDKV_CPU_ROUTES": "measure", "OMP_NUM_THREADS": "1"}
    tests = str(TESTS)
    procs = [subprocess.Popen([sys.executable, "-c", TWO_ENGINES, str(model), tests], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err[-2000:]
        assert out.startswith("ran Routes(")
    written = target.with_suffix(".routes.json")
    if written.exists():  # (absent only when both measured on a busy machine)
        assert set(json.loads(written.read_text())) == {"decode", "prefill", "linear"}
    assert {p.name for p in target.parent.iterdir()} <= {target.name, written.name}, "no temporary file is left"


@needs_compiler
def test_a_forced_torch_route_builds_a_backend_without_the_kernels_linears(monkeypatch):
    from pagedkv.backends.cpu.plugin import _build

    monkeypatch.setenv(routes.ENV, "linear=torch")
    backend = _build(type("Config", (), {"device": "cpu"})())
    assert backend.routes == Routes(linear=TORCH)
    assert backend.linear_kernel is None and backend.llama_layer_kernel is None
    monkeypatch.setenv(routes.ENV, "kernel")
    assert _build(type("Config", (), {"device": "cpu"})()).llama_layer_kernel is not None
    monkeypatch.setenv(routes.ENV, "nonsense")
    with pytest.raises(ConfigError):
        _build(type("Config", (), {"device": "cpu"})())

