"""TritonBackend against the torch reference backend, and how it picks the interpreter on CPU."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pagedkv.backends.base import AttentionBackend  # noqa: E402
from pagedkv.backends.torch_ref import TorchBackend  # noqa: E402
from pagedkv.backends.triton import split_kv_decode as split_module  # noqa: E402
from pagedkv.backends.triton.backend import INTERPRETER_NOTICE, TritonBackend  # noqa: E402
from pagedkv.core.kv.attention_metadata import AttentionMetadata  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU/interpreter set-up")


def config(device: str = DEVICE, dtype: torch.dtype = torch.float32, block_size: int = 16) -> SimpleNamespace:
    return SimpleNamespace(device=device, dtype=dtype, block_size=block_size)


def nan_caches(num_blocks: int, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype) -> tuple:
    shape = (num_blocks, block_size, kv_heads, dim)
    return tuple(torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))


def run_steps(backend, steps, tables, shape, dtype, seed=0) -> list[torch.Tensor]:  # noqa: ANN001
    """Drive one layer through several engine steps: write the step's K/V, then attend. Returns outputs."""
    num_blocks, block_size, heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = nan_caches(num_blocks, block_size, kv_heads, dim, dtype)
    outs = []
    for context_lens, query_lens in steps:
        meta = AttentionMetadata.build(
            block_tables=tables, context_lens=context_lens, query_lens=query_lens, block_size=block_size, device=DEVICE
        )
        tokens = sum(query_lens)
        qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        outs.append(backend.attend(q, k_cache, v_cache, meta, dim**-0.5))
    return [*outs, k_cache, v_cache]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_engine_steps_match_torch_backend(dtype: torch.dtype, tol: float, block_size: int) -> None:
    # Prefill two sequences, then a mixed step (decode, next prefill chunk, new prompt), then a decode-only step.
    steps = [
        ([0, 0, 0], [20, 7, 0]),
        ([20, 7, 0], [1, 9, 5]),
        ([21, 16, 5], [1, 1, 1]),
    ]
    max_len = 22
    blocks_per_seq = -(-max_len // block_size)
    order = torch.randperm(3 * blocks_per_seq + 2, generator=torch.Generator().manual_seed(block_size)).tolist()
    tables = [order[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(3)]
    shape = (3 * blocks_per_seq + 2, block_size, 8, 2, 64)

    got = run_steps(TritonBackend(config(dtype=dtype, block_size=block_size)), steps, tables, shape, dtype)
    want = run_steps(TorchBackend(DEVICE), steps, tables, shape, dtype)

    for step, (g, w) in enumerate(zip(got[:-2], want[:-2], strict=True)):
        assert not g.isnan().any(), f"step {step}: NaN in output"
        torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol, msg=f"step {step}")
    for g, w in zip(got[-2:], want[-2:], strict=True):  # the caches, NaN in unused slots included, are identical
        assert torch.equal(g.cpu().view(torch.uint8), w.cpu().view(torch.uint8))


@pytest.mark.parametrize("force_num_splits", [None, 1])
def test_long_decode_matches_torch_backend_with_and_without_split_kv(force_num_splits, monkeypatch) -> None:  # noqa: ANN001
    calls = []
    original = split_module.split_kv_decode
    monkeypatch.setattr(split_module, "split_kv_decode", lambda *a, **kw: calls.append(a[8]) or original(*a, **kw))
    block_size, dim = 16, 64
    lens = [700, 90]
    order = torch.randperm(60, generator=torch.Generator().manual_seed(3)).tolist()
    tables = [order[:44], order[44:50]]
    gen = torch.Generator().manual_seed(4)
    k_cache = torch.randn(60, block_size, 1, dim, generator=gen).to(DEVICE)
    v_cache = torch.randn(60, block_size, 1, dim, generator=gen).to(DEVICE)
    meta = AttentionMetadata.build(
        block_tables=tables, context_lens=[n - 1 for n in lens], query_lens=[1, 1], block_size=block_size, device=DEVICE
    )
    query = torch.randn(2, 4, dim, generator=gen).to(DEVICE)
    backend = TritonBackend(config())
    backend.force_num_splits = force_num_splits

    got = backend.attend(query, k_cache, v_cache, meta, 0.125)

    assert calls == ([2] if force_num_splits is None else [])  # 2 seqs x 1 KV head x 700 keys -> 2 splits
    want = TorchBackend(DEVICE).attend(query, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_copy_and_swap_blocks_match_torch_backend() -> None:
    gen = torch.Generator().manual_seed(5)
    layers = [tuple(torch.randn(6, 4, 2, 16, generator=gen).to(DEVICE) for _ in range(2)) for _ in range(2)]
    mine = [(k.clone(), v.clone()) for k, v in layers]
    ref = [(k.clone(), v.clone()) for k, v in layers]
    pairs = torch.tensor([[1, 4], [0, 5]])
    TritonBackend(config()).copy_blocks(mine, pairs.to(DEVICE))
    TorchBackend(DEVICE).copy_blocks(ref, pairs.to(DEVICE))
    for (a, b), (c, d) in zip(mine, ref, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)

    host = [(torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16)) for _ in range(2)]
    TritonBackend(config()).swap_blocks(mine, host, torch.tensor([[4, 2], [5, 0]]))
    for (k, v), (hk, hv) in zip(mine, host, strict=True):
        assert torch.equal(hk[2], k[4].cpu()) and torch.equal(hv[0], v[5].cpu())
        assert not hk[1].any() and not hv[1].any()


def test_backend_implements_the_interface_and_is_registered() -> None:
    from pagedkv.backends.triton.plugin import _build

    backend = _build(config())
    assert isinstance(backend, TritonBackend) and isinstance(backend, AttentionBackend)
    assert backend.name == "triton"


@cpu_only
def test_cpu_backend_warns_once_in_one_line_that_it_is_interpreted(caplog) -> None:  # noqa: ANN001
    with caplog.at_level(logging.WARNING, logger="pagedkv.backends.triton.backend"):
        backend = TritonBackend(config(device="cpu"))
    assert backend.interpreted
    notices = [r.getMessage() for r in caplog.records if r.name == "pagedkv.backends.triton.backend"]
    assert notices == [INTERPRETER_NOTICE]
    assert "\n" not in INTERPRETER_NOTICE and "slow" in INTERPRETER_NOTICE and "interpreter" in INTERPRETER_NOTICE


@cpu_only
def test_cpu_backend_refuses_interpreter_switched_off(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
        TritonBackend(config(device="cpu"))


@cpu_only
def test_cuda_device_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="no CUDA device"):
        TritonBackend(config(device="cuda"))


def run_fresh_python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )


@cpu_only
def test_fresh_process_on_cpu_gets_the_interpreter_set_by_the_backend() -> None:
    # triton itself is imported first, in compiled mode, as transformers does while building a model.
    result = run_fresh_python(
        """
        import os, types, torch
        import triton.language
        from pagedkv.backends.torch_ref import TorchBackend
        from pagedkv.backends.triton.backend import TritonBackend
        from pagedkv.core.kv.attention_metadata import AttentionMetadata
        backend = TritonBackend(types.SimpleNamespace(device="cpu", dtype=torch.float32, block_size=4))
        assert os.environ["TRITON_INTERPRET"] == "1"
        k_cache, v_cache = torch.zeros(4, 4, 1, 16), torch.zeros(4, 4, 1, 16)
        meta = AttentionMetadata.build(block_tables=[[2, 0], [3]], context_lens=[0, 2], query_lens=[5, 1], block_size=4)
        k, v, q = torch.randn(6, 1, 16), torch.randn(6, 1, 16), torch.randn(6, 2, 16)
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        assert torch.equal(k_cache[2, 1], k[1]) and torch.equal(v_cache[3, 2], v[5])
        torch.testing.assert_close(backend.attend(q, k_cache, v_cache, meta, 0.25),
                                   TorchBackend().attend(q, k_cache, v_cache, meta, 0.25))
        backend.force_num_splits = 2
        meta = AttentionMetadata.build(block_tables=[[2, 0], [3]], context_lens=[4, 2], query_lens=[1, 1], block_size=4)
        torch.testing.assert_close(backend.attend(q[:2], k_cache, v_cache, meta, 0.25),
                                   TorchBackend().attend(q[:2], k_cache, v_cache, meta, 0.25))
        backend.copy_blocks([(k_cache, v_cache)], torch.tensor([[2, 1]]))
        assert torch.equal(k_cache[1], k_cache[2])
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert result.stderr.count(INTERPRETER_NOTICE) == 1


@cpu_only
def test_kernels_imported_for_gpu_then_used_on_cpu_is_a_clear_error() -> None:
    result = run_fresh_python(
        """
        import types, torch
        import pagedkv.backends.triton.write_kv  # defined for the GPU: TRITON_INTERPRET is unset
        from pagedkv.backends.triton.backend import TritonBackend
        try:
            TritonBackend(types.SimpleNamespace(device="cpu", dtype=torch.float32, block_size=4))
        except RuntimeError as exc:
            print(exc)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "set TRITON_INTERPRET=1" in result.stdout
