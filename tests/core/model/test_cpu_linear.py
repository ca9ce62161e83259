"""fp32 linears through oneDNN packed weights (pagedkv.core.model.cpu_linear): right results, used only inside the
model runner's forward, never stale, and the module keeps its hooks."""

from __future__ import annotations

import pytest
import torch

from pagedkv.core.model import cpu_linear
from pagedkv.core.model.cpu_linear import PackedLinear, pack_linears, packed_linears

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN")


def _model(bias: bool = True, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers = torch.nn.Linear(48, 160, bias=bias), torch.nn.SiLU(), torch.nn.Linear(160, 48, bias=bias)
    return torch.nn.Sequential(*layers)


def _reference(model: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The same layers in float64."""
    out = x.double()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            bias = None if layer.bias is None else layer.bias.double()
            out = torch.nn.functional.linear(out, layer.weight.double(), bias)
        else:
            out = layer(out)
    return out


@pytest.mark.parametrize("rows", [1, 7, 64, 130])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linears_match_a_float64_reference(rows, bias):
    model = _model(bias)
    assert pack_linears(model) == 2
    assert all(type(layer) is PackedLinear for layer in (model[0], model[2]))
    x = torch.randn(1, rows, 48)
    with torch.inference_mode(), packed_linears():
        got = model(x)
    assert got.dtype == torch.float32 and got.shape == (1, rows, 48)
    torch.testing.assert_close(got.double(), _reference(model, x), rtol=1e-5, atol=1e-5)


def test_the_packed_weight_is_used_only_inside_packed_linears(monkeypatch):
    """A pack made from twice the weight shows which path ran: packed inside the block, plain outside."""
    monkeypatch.setattr(cpu_linear, "onednn_pack",
                        lambda w: torch.ops.mkldnn._reorder_linear_weight(2 * w.detach(), None))
    layer = torch.nn.Linear(32, 24, bias=False)
    pack_linears(layer)
    x = torch.randn(5, 32)
    plain = torch.nn.functional.linear(x, layer.weight)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), plain)
        with packed_linears():
            torch.testing.assert_close(layer(x), 2 * plain)
            torch.testing.assert_close(layer(x[:1]), plain[:1])  # one row: MKL's gemv (cpu_linear.MIN_ROWS)
            with packed_linears(False):
                torch.testing.assert_close(layer(x), plain)
        torch.testing.assert_close(layer(x), plain)


def test_a_replaced_or_edited_weight_is_repacked():
    layer = torch.nn.Linear(32, 24)
    pack_linears(layer)
    x = torch.randn(3, 32)
    with torch.no_grad():
        layer.weight.mul_(-3.0)  # in place: a new version of the same storage
        with packed_linears():
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        layer.weight = torch.nn.Parameter(torch.randn(24, 32), requires_grad=False)  # a new tensor
        with packed_linears():
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_forward_hooks_and_parameters_survive_packing():
    layer = torch.nn.Linear(16, 8)
    weight, calls = layer.weight, []
    layer.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    pack_linears(layer)
    assert layer.weight is weight and [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    with torch.inference_mode(), packed_linears():
        layer(torch.randn(2, 16))
    assert calls == [torch.Size([2, 8])]
    assert pack_linears(layer) == 1  # again: nothing changes


def test_weights_pack_at_their_first_packed_call_not_before():
    """Start-up: ``pack_linears`` only upgrades the modules; each weight is packed when first used packed."""
    model = _model()
    assert pack_linears(model) == 2
    assert model[0]._pack is None and model[2]._pack is None
    x = torch.randn(4, 48)
    with torch.inference_mode():
        model(x)  # outside packed_linears: plain arithmetic, nothing packed
    assert model[0]._pack is None
    with torch.inference_mode(), packed_linears():
        model(x)
    assert model[0]._pack is not None and model[2]._pack is not None


def test_a_packed_model_can_be_copied_and_pickled():
    """The pack is a cache: deepcopy and pickle leave it out, and the copy packs its own on first use."""
    import copy
    import io

    model = _model()
    pack_linears(model)
    x = torch.randn(6, 48)
    with torch.inference_mode(), packed_linears():
        expected = model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert type(clone[0]) is PackedLinear and clone[0].weight is not model[0].weight
        with torch.inference_mode(), packed_linears():
            torch.testing.assert_close(clone(x), expected, rtol=0, atol=0)


def test_only_float32_cpu_linears_are_packed():
    model = _model().to(torch.bfloat16)
    assert pack_linears(model) == 0
    assert all(type(layer) is torch.nn.Linear for layer in (model[0], model[2]))
    x = torch.randn(4, 48, dtype=torch.bfloat16)
    with torch.inference_mode(), packed_linears():
        assert model(x).dtype == torch.bfloat16


def test_the_engine_packs_and_leaves_the_model_plain_outside_it(tiny_llama, references):
    """After an engine ran on the model, transformers' own generate on the same instance still matches the
    reference made before (the packed path is the runner's only)."""
    from conftest import GREEDY_MAX_NEW, hf_greedy
    from pagedkv import LLM, SamplingParams

    prompts, expected = references
    llm = LLM(hf_model=tiny_llama, device="cpu", num_blocks=64, block_size=16)
    assert llm.engine.runner.packed_linears
    assert any(isinstance(m, PackedLinear) for m in tiny_llama.modules())
    outs = llm.generate(prompts[:2], SamplingParams(max_tokens=GREEDY_MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected["llama"][:2]
    assert hf_greedy(tiny_llama, prompts[0], GREEDY_MAX_NEW) == expected["llama"][0]


def test_no_packing_when_the_copies_would_not_fit_in_memory(monkeypatch, caplog):
    model = _model()
    monkeypatch.setattr(cpu_linear, "available_memory", lambda: 1000)  # bytes: far less than 2x the weights
    with caplog.at_level("WARNING", logger="pagedkv"):
        assert pack_linears(model) == 0
    assert all(type(layer) is torch.nn.Linear for layer in (model[0], model[2]))
    assert len(caplog.records) == 1 and "not packing" in caplog.records[0].getMessage()
