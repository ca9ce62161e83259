"""The torch backend's per-layer work never makes the host wait for the device.

On CUDA every ``.item()``, ``bool(tensor)``, ``.cpu()``, ``.tolist()``, boolean
indexing or ``repeat_interleave`` without ``output_size`` in a layer stalls the
CPU once per layer per step. On the CPU such calls cost nothing, so this test
counts them instead: the operations that would sync are wrapped while a layer
runs (``write_kv`` and ``attend``) and must never be called, through prefill
chunks, decodes, a sliding window and softcapping. On a GPU the same run uses
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import random_prompts
from pagedkv import LLM, SamplingParams

SYNCING_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")


class SyncCounter:
    """Counts calls of device-syncing operations made while ``active``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.active = False
        self.calls: list[str] = []
        self.layers = 0
        for name in SYNCING_METHODS:
            self._wrap(monkeypatch, torch.Tensor, name, getattr(torch.Tensor, name))
        self._wrap(monkeypatch, torch, "nonzero", torch.nonzero)
        self._wrap(monkeypatch, torch, "masked_select", torch.masked_select)
        original_ri = torch.repeat_interleave

        def repeat_interleave(input, repeats=None, *args, **kwargs):  # noqa: A002 - torch's own argument name
            if self.active and isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
                self.calls.append("repeat_interleave without output_size")
            return original_ri(input, repeats, *args, **kwargs)

        monkeypatch.setattr(torch, "repeat_interleave", repeat_interleave)
        original_getitem = torch.Tensor.__getitem__

        def getitem(tensor, index):
            if self.active:
                parts = index if isinstance(index, tuple) else (index,)
                if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                    self.calls.append("boolean-mask indexing")
            return original_getitem(tensor, index)

        monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)

    def _wrap(self, monkeypatch: pytest.MonkeyPatch, owner, name: str, original) -> None:
        def wrapper(*args, **kwargs):
            if self.active:
                self.calls.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    @contextlib.contextmanager
    def layer(self):
        self.layers += 1
        self.active = True
        try:
            yield
        finally:
            self.active = False


def instrument(backend, counter: SyncCounter, monkeypatch: pytest.MonkeyPatch, guard=None) -> None:
    """Run the backend's per-layer methods inside the counter (and ``guard``, e.g. CUDA's sync debug mode)."""
    for name in ("write_kv", "attend"):
        original = getattr(backend, name)

        def wrapped(*args, _original=original, **kwargs):
            with counter.layer(), (guard() if guard else contextlib.nullcontext()):
                return _original(*args, **kwargs)

        monkeypatch.setattr(backend, name, wrapped)


def windowed_mistral(device: str):
    from transformers import MistralConfig, MistralForCausalLM

    from conftest import VOCAB

    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=5, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    return MistralForCausalLM(cfg).eval().to(device)


def run_counted(model, device: str, monkeypatch: pytest.MonkeyPatch, guard=None) -> SyncCounter:
    counter = SyncCounter(monkeypatch)
    llm = LLM(hf_model=model, device=device, backend="torch", block_size=4, num_blocks=64, max_num_batched_tokens=9)
    instrument(llm.engine.backend, counter, monkeypatch, guard)
    prompts = random_prompts([3, 14, 7], seed=2)  # 14 > 9: a prefill chunk after cached context
    llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    return counter


def test_the_counter_sees_a_sync(monkeypatch):
    counter = SyncCounter(monkeypatch)
    with counter.layer():
        bool(torch.tensor([True]))
        torch.arange(4)[torch.tensor([True, False, True, False])]
        torch.repeat_interleave(torch.arange(2), torch.tensor([1, 2]))
    assert counter.calls == ["__bool__", "boolean-mask indexing", "repeat_interleave without output_size"]


@pytest.mark.parametrize("arch", ["llama", "mistral-window"])
def test_layers_make_no_host_sync_on_cpu(tiny_models, arch, monkeypatch):
    model = tiny_models["llama"] if arch == "llama" else windowed_mistral("cpu")
    counter = run_counted(model, "cpu", monkeypatch)
    assert counter.layers > 2 * 2 * 5, "the layers were not instrumented"
    assert counter.calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layers_make_no_host_sync_on_cuda(monkeypatch):
    @contextlib.contextmanager
    def sync_errors():
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    counter = run_counted(windowed_mistral("cuda"), "cuda", monkeypatch, guard=sync_errors)
    assert counter.layers > 0
    assert counter.calls == []
