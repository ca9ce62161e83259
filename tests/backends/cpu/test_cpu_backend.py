"""The compiled CPU backend against a float64 reference, and token-identical to transformers."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from attention_cases import make_case, reference

from conftest import GREEDY_MAX_NEW, cpu_kernel_build, hf_greedy
from pagedkv import LLM, SamplingParams
from pagedkv.backends.cpu import build

# Every build of the kernel this machine can execute, and the route that sends prefills to torch
# (taken where a build's prefill is slower than torch's); the AVX-512 build on a CPU without it is
# still compiled (test_every_build_compiles) but skipped here, and its loops, tile sizes and shuffle
# masks run here anyway in the avx512-shape build (simd.h).
BACKENDS = [*build.checked_variants(), "generic/prefill-by-torch" if build.is_x86() else "native/prefill-by-torch"]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    from pagedkv.backends.cpu import CpuBackend
    from pagedkv.backends.cpu.routes import Routes

    isa, _, route = request.param.partition("/")
    lib = cpu_kernel_build(isa)
    return CpuBackend(lib, routes=Routes(prefill="torch") if route else Routes())


def check(backend, seq_lens, query_lens, block_size=16, heads=4, kv_heads=2, dim=64, dtype=torch.float32,
          window=None, softcap=None, seed=0, query=None):
    meta, q, k_cache, v_cache, keys, values = make_case(
        seq_lens, query_lens, block_size, heads, kv_heads, dim, dtype, seed
    )
    if query is not None:
        q = query(q)
    scale = 1.0 / math.sqrt(dim)
    out = backend.attend(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "NaN from unused cache slots reached the output"
    # bf16: inputs are exact bf16 values; the kernel computes in fp32 and rounds the output once.
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    start = 0
    for n, q_len, k, v in zip(seq_lens, query_lens, keys, values):
        expected = reference(q[start : start + q_len], k, v, n - q_len, scale, window, softcap)
        torch.testing.assert_close(out[start : start + q_len].double(), expected, atol=tol, rtol=tol)
        start += q_len


@pytest.mark.parametrize("block_size", [1, 3, 16, 32, 256])
def test_decode_lengths_around_block_edges(backend, block_size):
    lengths = [1, block_size - 1 or 1, block_size, block_size + 1, 2 * block_size + 5, 300]
    check(backend, lengths, [1] * len(lengths), block_size, seed=block_size)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])
def test_gqa_groups_read_one_kv_head(backend, group):
    check(backend, [40, 1, 77], [1, 1, 5], 16, heads=2 * group, kv_heads=2, seed=group)


@pytest.mark.parametrize("block_size", [1, 7, 16, 64])
def test_prefill_without_cached_prefix_is_causal(backend, block_size):
    check(backend, [1, 37, 130], [1, 37, 130], block_size, seed=block_size)


@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_prefill_chunks_over_a_cached_prefix_mixed_with_decodes(backend, block_size):
    # context not block aligned, chunks longer than the query tile, decodes in the same call
    check(backend, [50, 200, 9, 64], [13, 70, 1, 1], block_size, heads=6, kv_heads=2, seed=block_size)


@pytest.mark.parametrize("dim", [32, 64, 80, 128, 256])
def test_head_dims_specialised_and_generic(backend, dim):
    check(backend, [33, 5], [1, 5], 16, dim=dim, seed=dim)


@pytest.mark.parametrize("block_size", [5, 16])
def test_bfloat16_caches_within_bf16_tolerance(backend, block_size):
    check(backend, [100, 18, 1], [1, 18, 1], block_size, heads=9, kv_heads=3, dtype=torch.bfloat16)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window_hides_keys_left_of_it(backend, window):
    check(backend, [70, 30, 3], [1, 30, 3], 8, window=window, seed=window)
    check(backend, [120], [45], 16, window=window, seed=window + 1)


@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0])
def test_logit_softcap(backend, softcap):
    # scaled-up queries so that the cap changes the scores a lot
    check(backend, [60, 25], [1, 25], 16, softcap=softcap, query=lambda q: q * 8, seed=3)
    check(backend, [60, 25], [1, 25], 16, softcap=softcap, window=7, query=lambda q: q * 8, seed=4)


# --- the prefill path (prefill.h): query tiles of many rows, in register blocks of 6 rows ---------------------


@pytest.mark.parametrize("group", [1, 3, 4])
def test_prefill_rows_in_every_block_remainder(backend, group):
    # rows = tokens x group: every remainder mod 6 of a tile's rows, with and without a cached prefix
    lengths = list(range(2, 15))
    check(backend, lengths, lengths, 16, heads=2 * group, kv_heads=2, seed=group)
    check(backend, [n + 21 for n in lengths], lengths, 16, heads=2 * group, kv_heads=2, seed=10 + group)


@pytest.mark.parametrize("block_size", [1, 16, 48, 256])
def test_long_prefill_over_many_key_chunks(backend, block_size):
    # several 64-key chunks and query tiles; prefixes that end inside a chunk; causal edges inside a chunk
    check(backend, [200, 333, 129], [200, 140, 65], block_size, heads=9, kv_heads=3, seed=block_size)


@pytest.mark.parametrize("window", [3, 64, 100])
def test_prefill_window_across_chunks_over_a_cached_prefix(backend, window):
    # rows whose window has left whole chunks behind, and chunks that only some rows of a block see
    check(backend, [260, 90], [150, 90], 16, heads=6, kv_heads=3, window=window, seed=window)


@pytest.mark.parametrize("dim", [32, 128, 256])
def test_prefill_head_dims_over_a_cached_prefix(backend, dim):
    check(backend, [150, 40], [70, 40], 16, heads=4, kv_heads=1, dim=dim, seed=dim)


def test_bfloat16_prefill_over_a_cached_prefix(backend):
    check(backend, [230, 64], [100, 64], 16, heads=9, kv_heads=3, dtype=torch.bfloat16, seed=5)
    check(backend, [230], [100], 16, heads=9, kv_heads=3, dtype=torch.bfloat16, window=40, seed=6)


def test_prefill_with_softcap_over_chunks(backend):
    check(backend, [180], [120], 16, heads=6, kv_heads=2, softcap=2.0, query=lambda q: q * 8, seed=7)


def test_prefill_query_as_a_strided_view(backend):
    check(backend, [140, 70], [100, 70], 16, heads=9, kv_heads=3,
          query=lambda q: q.transpose(0, 1).contiguous().transpose(0, 1))


def test_context_one_and_a_single_query_head(backend):
    check(backend, [1], [1], 16, heads=1, kv_heads=1)


def test_query_as_a_strided_view(backend):
    # what transformers hands over: [H, T, D] memory seen as [T, H, D]
    check(backend, [30, 12], [3, 12], 16, query=lambda q: q.transpose(0, 1).contiguous().transpose(0, 1))


def test_output_is_freshly_written_not_poison(backend):
    meta, q, k_cache, v_cache, *_ = make_case([20], [1], 16, 4, 2, 64, torch.float32, 0)
    first = backend.attend(q, k_cache, v_cache, meta, 0.125)
    again = backend.attend(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(first, again) and torch.isfinite(first).all()


def test_bad_arguments_fail_with_one_clear_error(backend):
    meta, q, k_cache, v_cache, *_ = make_case([20], [1], 16, 4, 2, 64, torch.float32, 0)
    with pytest.raises(ValueError, match="window"):
        backend.attend(q, k_cache, v_cache, meta, 0.125, window=0)
    with pytest.raises(ValueError, match="softcap"):
        backend.attend(q, k_cache, v_cache, meta, 0.125, softcap=-1.0)
    with pytest.raises(ValueError, match="query heads"):
        backend.attend(q[:, :3], k_cache, v_cache, meta, 0.125)


def test_build_cache_key_covers_every_source_and_header(monkeypatch, tmp_path):
    # an edit to one header or one translation unit alone must not load a library built from the old file
    for name in (*build.SOURCES, *build.HEADERS):
        (tmp_path / name).write_bytes((build.SOURCE_DIR / name).read_bytes())
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path)
    for name in ("prefill.h", "kv_write.cpp"):
        before = build.library_path()
        edited = tmp_path / name
        edited.write_text(edited.read_text() + "\n// edited\n")
        assert build.library_path() != before
    assert '#include "prefill.h"' in (tmp_path / "attention.cpp").read_text()


def test_missing_compiler_falls_back_to_the_reference_with_one_log_line(monkeypatch, tmp_path, caplog):
    from pagedkv.backends.cpu import plugin
    from pagedkv.core.config import EngineConfig

    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path))  # nothing cached: a build would be needed
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    build.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="pagedkv"):
            chosen = plugin._build(EngineConfig(backend="cpu", device="cpu", num_blocks=4))
    finally:
        build.load.cache_clear()
    assert chosen.name == "torch"
    lines = [r.getMessage() for r in caplog.records if "CPU attention kernel unavailable" in r.getMessage()]
    assert len(lines) == 1 and "no C++ compiler" in lines[0]
    assert not any(tmp_path.rglob("*.so"))


# --- whole model: greedy tokens identical to transformers' generate ------------------------------------------

MAX_NEW = GREEDY_MAX_NEW  # (transformers' greedy tokens for each tiny model: conftest's ``references``;
# the plain equality test over architectures and block sizes runs for both backends in test_generate_matches_hf)


def test_greedy_tokens_match_with_chunked_prefill_and_prefix_cache(backend, tiny_models, references, monkeypatch):
    from pagedkv.backends.cpu import plugin

    monkeypatch.setattr(plugin, "_build", lambda config: backend)  # this build and route, in the whole engine
    prompts, refs = references
    llm = LLM(hf_model=tiny_models["qwen2"], device="cpu", backend="cpu", block_size=4, num_blocks=256,
              max_num_batched_tokens=7, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs["qwen2"]
    assert [o.token_ids for o in llm.generate(prompts, params)] == refs["qwen2"]  # now over cached prefixes
    assert llm.engine.stats.steps > MAX_NEW + 64 // 7
    assert llm.engine.backend is backend


@pytest.mark.slow
def test_smollm2_greedy_tokens_match_transformers(smollm2):
    model, tokenizer = smollm2
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    refs = [hf_greedy(model, p, 24) for p in prompts]
    llm = LLM(hf_model=model, tokenizer=tokenizer, device="cpu", backend="cpu", block_size=16, num_blocks=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs


def test_auto_backend_is_the_compiled_kernel_on_cpu(backend, tiny_llama):
    llm = LLM(hf_model=tiny_llama, device="cpu", num_blocks=16)
    assert llm.engine.config.backend == "cpu" and llm.engine.backend.name == "cpu"
    assert LLM(hf_model=tiny_llama, device="cpu", num_blocks=16, backend="torch").engine.backend.name == "torch"
