"""fp32 linear layers on the CPU through oneDNN, with each weight packed once.

A decode step multiplies a few dozen rows by every weight matrix of the model, and on the
CPU those small-M products are most of the step. torch's ``F.linear`` hands them to MKL
sgemm on the weight's plain ``[out, in]`` layout; oneDNN with the weight reordered once
into its own blocked layout (what ``torch.compile``'s CPU freezing and vLLM's CPU backend
do) is faster at those sizes (the figures: ``benchmarks/JOURNAL.md``). It rounds differently
from MKL (both are plain fp32 sums in another order); greedy outputs stay token-identical
to transformers in the tests.

:func:`pack_linears` upgrades a model's fp32 ``nn.Linear`` modules in place to
:class:`PackedLinear`. The packed path runs only inside :func:`packed_linears` (the
model runner's forward); any other caller of the model, e.g. transformers ``generate``
on the same instance, gets plain ``nn.Linear`` arithmetic. The packed copy costs the
memory of the weights once more.

A backend may offer its own kernel for these products (a :class:`LinearKernel`, declared by
:class:`HasLinearKernel`): the cpu backend's ``linear.h`` streams the weights better than oneDNN at
decode sizes. The runner then passes it to :func:`packed_linears`, and the weights are packed in that
kernel's layout instead of oneDNN's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol, runtime_checkable

import torch

from pagedkv.core.limits import available_memory

log = logging.getLogger("pagedkv")

@runtime_checkable
class LinearKernel(Protocol):
    """A backend's CPU linear ``y = x W^T + b`` on a weight it packed once in its own layout."""

    name: str  # identifies the packed layout: a pack is remade for a kernel of another name
    dtypes: tuple[torch.dtype, ...]  # the weight dtypes it multiplies (the input then has the weight's dtype)

    def pack(self, weight: torch.Tensor) -> torch.Tensor: ...

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor: ...


@runtime_checkable
class HasLinearKernel(Protocol):
    """An attention backend that also offers the linears' kernel (None when it has none for this machine)."""

    linear_kernel: LinearKernel | None


ONEDNN = "onednn"  # the packing when no backend kernel is given
_ACTIVE: ContextVar[LinearKernel | str | None] = ContextVar("pagedkv_packed_linears", default=None)
# A single row is a matrix-vector product, bound by reading the weight; there MKL's gemv is a few % faster
# than oneDNN (whose call costs ~10 us more); from 2 rows on oneDNN wins (measured on SmolLM2's layers).
MIN_ROWS = 2


def available() -> bool:
    """Whether this torch build has oneDNN and the linear ops used here."""
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available()) and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    )


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` that, inside :func:`packed_linears`, multiplies fp32 CPU inputs by a oneDNN-packed copy
    of its weight. The copy is remade whenever the weight is replaced or changed in place (tensor-parallel
    sharding, ``model.to``, ``load_state_dict``), so it never goes stale."""

    _pack: torch.Tensor | None = None
    _pack_key: tuple | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's own parameter name
        packing = _ACTIVE.get()
        if packing is not None and input.device.type == "cpu":
            if packing == ONEDNN:
                if input.dtype == torch.float32 and input.numel() >= MIN_ROWS * input.shape[-1]:
                    pack = self.packed_weight()
                    if pack is not None:
                        return torch.ops.mkldnn._linear_pointwise(input, pack, self.bias, "none", [], "")
            elif input.dtype == self.weight.dtype and (self.bias is None or self.bias.dtype == input.dtype):
                pack = self.packed_weight(packing)
                if pack is not None:
                    return packing.linear(input, pack, self.bias, self.out_features)
        return super().forward(input)

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the pack out (an opaque oneDNN tensor has no storage to copy); they repack
        on first use."""
        state = dict(self.__dict__)
        state.pop("_pack", None)
        state.pop("_pack_key", None)
        return state

    def packed_weight(self, kernel: LinearKernel | None = None) -> torch.Tensor | None:
        """The weight packed for ``kernel`` (default oneDNN), (re)made if the weight or the kernel changed;
        None when the weight is not on the CPU in a dtype the packing takes (fp32; the kernel's ``dtypes``)."""
        weight = self.weight
        key = (weight_key(weight), ONEDNN if kernel is None else kernel.name)
        if key != self._pack_key:
            self._pack = None  # (the old pack is let go before the new one is made)
            if _packable(weight, kernel):
                with torch.no_grad():
                    self._pack = onednn_pack(weight) if kernel is None else kernel.pack(weight.detach().contiguous())
            self._pack_key = key
        return self._pack


def pack_linears(model: torch.nn.Module, kernel: LinearKernel | None = None) -> int:
    """Make every fp32 CPU ``nn.Linear`` of ``model`` a :class:`PackedLinear`, whose weight is packed at its
    first multi-row call inside :func:`packed_linears` (not here: packing every weight at once was seconds of
    engine start-up, and a server that never steps never needs it); returns how many linears will pack (0
    without oneDNN or a ``kernel``, or when the packed copies would not fit in the memory available now: then
    one log line, and the model runs as it is). Idempotent."""
    if kernel is None and not available():
        return 0
    if not packed_copies_fit(model, warn=True, kernel=kernel):
        return 0
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and _packable(module.weight, kernel):
            # The class is changed in place, not the module replaced, so everything attached to it stays:
            # its forward hooks (tensor parallel's all-reduce), parameters, tied weights, name. PackedLinear
            # adds no state but its pack (torch.nn.utils.parametrize upgrades modules the same way).
            module.__class__ = PackedLinear
        if isinstance(module, PackedLinear) and _packable(module.weight, kernel):
            count += 1
    return count


def packed_copies_fit(model: torch.nn.Module, warn: bool = False, kernel: LinearKernel | None = None) -> bool:
    """Whether a packed copy of every fp32 CPU linear weight of ``model`` fits in half the memory available now
    (the other half is left to the KV cache and the step's activations). A backend's fused layers pack the same
    weights, so they ask this too."""
    needed = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                 if isinstance(m, torch.nn.Linear) and _packable(m.weight, kernel) and m.__dict__.get("_pack") is None)
    free = available_memory()
    if free is not None and needed > free // 2:
        if warn:
            log.warning("pagedkv: not packing the linear layers: %.2f GiB needed, %.2f GiB available",
                        needed / 2**30, free / 2**30)
        return False
    return True


@contextmanager
def packed_linears(enabled: bool = True, kernel: LinearKernel | None = None) -> Iterator[None]:
    """Within this block (and this thread/context), :class:`PackedLinear` modules use their packed weights:
    ``kernel``'s when given, else oneDNN's."""
    token = _ACTIVE.set((kernel or ONEDNN) if enabled else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _packable(weight: torch.Tensor, kernel: LinearKernel | None = None) -> bool:
    """fp32 CPU matrices; for a backend's kernel, those of its ``dtypes`` (oneDNN's path here is fp32 only)."""
    dtypes = (torch.float32,) if kernel is None else kernel.dtypes
    return weight.dtype in dtypes and weight.device.type == "cpu" and weight.dim() == 2 and weight.numel() > 0


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` reordered once into oneDNN's blocked layout (what ``_linear_pointwise`` multiplies by)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def weight_key(weight: torch.Tensor) -> tuple[Any, ...]:
    """What identifies the weight's current contents: storage, layout, and (when tracked) the in-place version."""
    version = None if weight.is_inference() else weight._version
    return weight.data_ptr(), weight.dtype, weight.device, tuple(weight.shape), weight.stride(), version
