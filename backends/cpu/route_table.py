"""Where each phase of the cpu backend runs: its compiled kernel, or torch's reference (``routes.py`` decides)."""

from __future__ import annotations

from dataclasses import dataclass

KERNEL, TORCH = "kernel", "torch"


@dataclass(frozen=True)
class Routes:
    """Where each phase runs: ``"kernel"`` or ``"torch"``."""

    decode: str = KERNEL
    prefill: str = KERNEL
    linear: str = KERNEL  # the model's fp32 linears: the kernel's (linear.h), or "torch" (oneDNN / MKL)
