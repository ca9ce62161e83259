"""The one engine configuration: validated on construction, passed whole."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.core.errors import ConfigError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(value: str | torch.dtype) -> torch.dtype | str:
    """A torch dtype from its name; ``"auto"`` stays ``"auto"`` (the engine decides once its backend is built,
    see :mod:`pagedkv.core.dtype_choice`)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ConfigError(f"dtype {value} is not supported; use float32, bfloat16 or float16")
        return value
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {value!r}; use one of auto, float32, bfloat16, float16") from None


KV_CACHE_DTYPES = {  # --kv-cache-dtype names; the 8-bit row format is core/kv/kv_dtype.py's
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPE_NAMES = ("auto", *KV_CACHE_DTYPES)


def parse_kv_cache_dtype(value: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype for ``--kv-cache-dtype`` (``auto``/None: the model dtype); one error line otherwise."""
    name = "auto" if value is None else str(value).lower()
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"unknown kv_cache_dtype {value!r}; use one of {', '.join(KV_CACHE_DTYPE_NAMES)}")
    return KV_CACHE_DTYPES[name]


def parse_bytes(value: int | str) -> int:
    """Accept ``1073741824``, ``"1GiB"``, ``"512MiB"``, ``"2GB"``, and ``"1G"``/``"512M"`` (binary, as llama.cpp
    and vLLM's ``--swap-space`` read them: 1G = 1GiB)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip().replace(" ", "")
    number, scale = text, 1
    for suffix, unit in _SIZE_UNITS.items():
        if text.lower().endswith(suffix):
            number, scale = text[: -len(suffix)], unit
            break
    try:
        amount = float(number)
    except ValueError:
        raise ConfigError(f"cannot read {value!r} as a size in bytes (e.g. 1GiB, 512M, 1000000)") from None
    if not math.isfinite(amount) or amount < 0:
        raise ConfigError(f"size {value!r} is not a finite, non-negative number of bytes")
    if amount * scale >= 2**63:
        raise ConfigError(f"size {value!r} is too large")
    return int(amount * scale)


_SIZE_UNITS = {  # longest suffixes first; a bare K/M/G/T is binary
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "b": 1,
}


MODEL_IMPLS = ("auto", "pagedkv", "transformers")


def parse_model_impl(value: str | None) -> str:
    """``model_impl`` as one of :data:`MODEL_IMPLS`; ``vllm`` (vLLM's name for its own code) is ours here."""
    name = str(value or "auto").lower()
    name = "pagedkv" if name == "vllm" else name
    if name not in MODEL_IMPLS:
        raise ConfigError(f"model_impl must be one of auto, pagedkv (alias vllm), transformers; got {value!r}")
    return name


QUANTIZATIONS = ("gguf", "int8", "int4")
# Names a user may reasonably try that pagedkv does not run, each refused with its own reason (vLLM's names).
_NOT_IMPLEMENTED = {
    "int4_g128": "int4 runs group 32 (Q4_1 blocks); group 128 needs a block format the kernels do not take",
}


def parse_quantization(value: str | None) -> str | None:
    """``quantization`` (vLLM's flag) as None (the checkpoint's weights, a GGUF file de-quantized to float32) or one
    of :data:`QUANTIZATIONS`; any other method is refused by name, never ignored."""
    if value in (None, "", "none", "None"):
        return None
    name = str(value).lower()
    if name not in QUANTIZATIONS:
        reason = _NOT_IMPLEMENTED.get(name.replace("-", "_"))
        raise ConfigError(f"quantization {value!r} is not implemented" + (f" ({reason})" if reason else "") +
                          "; pagedkv runs: gguf (a GGUF file's Q8_0, Q4_0 and Q4_1 weights kept as their blocks), "
                          "int8 (a full-precision checkpoint quantized at load to Q8_0: 8-bit, a scale per 32 "
                          "values), int4 (quantized at load to Q4_1: 4-bit, scale and minimum per group of 32)")
    return name


@dataclass
class EngineConfig:
    """Everything the engine needs to know, checked once here.

    The KV budget is given by exactly one of ``num_blocks``, ``kv_cache_memory``
    (bytes) or, on CUDA, ``gpu_memory_utilization`` (fraction of the device
    left after profiling the model's peak). With none given, CPU runs get 1 GiB.
    """

    model: str | None = None
    revision: str | None = None  # of a hub id in the local Hugging Face cache
    model_impl: str = "auto"  # auto (pagedkv's Llama where it is exact, else transformers), pagedkv, transformers
    backend: str = "auto"  # "cpu" on CPU, else "torch" (resolved by the Engine)
    quantization: str | None = None  # None, or "gguf": a GGUF file's quantized weights kept as blocks
    allocator: str = "paged"
    scheduler: str = "fcfs"
    priority_aging_steps: int = 100  # priority scheduler: steps of waiting worth one priority level (0: none)
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | str | None = None  # None: the model's (capped by the cache); "auto": what the cache holds
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    dtype: str | torch.dtype = "auto"
    kv_cache_dtype: str = "auto"  # auto (the model dtype), bfloat16, float16, int8, fp8_e4m3, fp8_e5m2
    device: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = False
    enable_copy_on_write: bool = False
    swap_space: int | str | None = None
    telemetry: str | None = None
    trace: str | None = None
    structured_outputs_backend: str = "guidance"  # the grammar backend for constrained requests (llguidance)
    # grammar work bounded and fair (see core/sample/grammar_compiler.py): worker threads, a time limit per
    # compile, a size limit per constraint (bytes of its canonical text) and the compiled grammars' cache
    grammar_compile_workers: int = 2
    grammar_compile_timeout: float = 10.0
    max_grammar_bytes: int = 128 * 1024
    grammar_cache_bytes: int | str = 32 * 2**20
    plugin_options: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's storage dtype: ``kv_cache_dtype`` resolved (``auto`` is the model dtype)."""
        return parse_kv_cache_dtype(self.kv_cache_dtype, self.dtype)

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' was asked for but torch sees no CUDA device; use device='cpu'")
        self.dtype = parse_dtype(self.dtype)
        if self.dtype == torch.float16 and str(self.device).startswith("cpu"):
            raise ConfigError("float16 runs only on CUDA (CPU has no fast fp16 path); use float32 or bfloat16")
        self.kv_cache_dtype = "auto" if self.kv_cache_dtype is None else str(self.kv_cache_dtype).lower()
        parse_kv_cache_dtype(self.kv_cache_dtype, self.dtype)
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 256:
            raise ConfigError(f"block_size must be an integer in 1..256, got {self.block_size!r}")
        budgets = [x is not None for x in (self.num_blocks, self.kv_cache_memory, self.gpu_memory_utilization)]
        if sum(budgets) > 1:
            raise ConfigError("give only one of num_blocks, kv_cache_memory and gpu_memory_utilization")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ConfigError(f"num_blocks must be a positive integer, got {self.num_blocks!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
            if self.kv_cache_memory <= 0:
                raise ConfigError("kv_cache_memory must be positive")
        if self.gpu_memory_utilization is not None:
            if not self.device.startswith("cuda"):
                raise ConfigError("gpu_memory_utilization needs a CUDA device; on CPU give kv_cache_memory")
            if not 0.0 < self.gpu_memory_utilization <= 1.0:
                raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.max_model_len in ("auto", -1):
            self.max_model_len = "auto"
        elif self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ConfigError(f"max_model_len must be a positive integer or 'auto', got {self.max_model_len!r}")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be at least 1")
        aging = self.priority_aging_steps
        if isinstance(aging, bool) or not isinstance(aging, int) or not 0 <= aging <= 2**32:
            raise ConfigError(f"priority_aging_steps must be an integer in 0..2**32 (0: no aging), got {aging!r}")
        if self.swap_space is not None:
            self.swap_space = parse_bytes(self.swap_space)
            if self.swap_space < 0:
                raise ConfigError("swap_space must be >= 0 bytes")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        self.model_impl = parse_model_impl(self.model_impl)
        if self.model_impl == "pagedkv" and self.tensor_parallel_size > 1:
            raise ConfigError("model_impl pagedkv runs on one device; tensor parallelism uses transformers' model")
        self.quantization = parse_quantization(self.quantization)
        if self.quantization is not None and (self.tensor_parallel_size > 1 or self.model_impl == "transformers"):
            raise ConfigError(f"quantization {self.quantization} runs pagedkv's own Llama on one device (not "
                              "tensor parallel, not model_impl transformers)")
        if not self.backend or not isinstance(self.backend, str):
            raise ConfigError("backend must be a name such as 'torch', 'triton' or 'cupy'")
        self._check_grammar_limits()

    def _check_grammar_limits(self) -> None:
        if not isinstance(self.grammar_compile_workers, int) or self.grammar_compile_workers < 1:
            raise ConfigError(f"grammar_compile_workers must be at least 1, got {self.grammar_compile_workers!r}")
        if not isinstance(self.grammar_compile_timeout, (int, float)) or not self.grammar_compile_timeout > 0:
            raise ConfigError(f"grammar_compile_timeout must be positive seconds, got {self.grammar_compile_timeout!r}")
        if not isinstance(self.max_grammar_bytes, int) or self.max_grammar_bytes < 1:
            raise ConfigError(f"max_grammar_bytes must be a positive integer, got {self.max_grammar_bytes!r}")
        self.grammar_cache_bytes = parse_bytes(self.grammar_cache_bytes)
        if self.grammar_cache_bytes < 0:
            raise ConfigError("grammar_cache_bytes must be >= 0 bytes")
