"""The engine flags ``engine run`` and ``engine serve`` share, spelled and read as ``vllm serve`` reads them.

One definition for both commands, so a flag means the same everywhere: ``--swap-space 4`` is 4 GiB
(vLLM's unit; ``4MiB`` still works), ``--max-model-len`` takes ``32k`` (decimal), ``32K`` (binary)
and ``auto`` (as long as the cache holds), ``--dtype auto`` is the checkpoint's dtype, and vLLM's
aliases (``--kv-cache-memory-bytes``, ``--num-gpu-blocks-override``) and always-on or no-op
switches (``--enable-chunked-prefill``, ``--enforce-eager``) are accepted. Every default shows in
``--help``.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from pagedkv.core.errors import ConfigError

_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_int(text: str) -> int:
    """vLLM's reading of ``--max-model-len``: ``32k`` = 32,000, ``32K`` = 32,768, ``25.6k`` = 25,600."""
    match = _HUMAN_INT.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r} (e.g. 4096, 32k, 32K)")
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: decimals go with k/m/g/t (decimal) suffixes only")
    return int(number) * _BINARY.get(suffix, 1)


def model_len(text: str) -> int | str:
    """``--max-model-len``: a human integer, or ``auto`` / ``-1`` (the longest the KV cache holds)."""
    if text.strip().lower() in ("auto", "-1"):
        return "auto"
    return human_int(text)


def swap_size(text: str) -> int:
    """``--swap-space``: a bare number is GiB (vLLM's unit); a size with a unit (``512MiB``, ``1GB``) is that size."""
    from pagedkv.core.config import parse_bytes

    stripped = text.strip()
    try:
        return int(float(stripped) * 2**30)
    except ValueError:
        pass
    try:
        return parse_bytes(stripped)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def byte_size(text: str) -> int:
    """A size in bytes: ``536870912``, ``512MiB``, ``1GB``, ``512M``."""
    from pagedkv.core.config import parse_bytes

    try:
        return parse_bytes(text.strip())
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def plugin_option(text: str) -> tuple[str, str, Any]:
    """``plugin.key=value`` -> (plugin, key, value); the value is read as JSON when it is JSON, else text."""
    head, sep, raw = text.partition("=")
    plugin, dot, key = head.partition(".")
    if not (sep and dot and plugin and key):
        raise argparse.ArgumentTypeError(f"--plugin-option takes plugin.key=value, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return plugin, key, value


class _RefuseNo(argparse.Action):
    """``--enable-chunked-prefill`` is accepted (pagedkv always chunks prefills); its ``--no-`` form is refused."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        if option_string and option_string.startswith("--no-"):
            parser.error(f"{option_string}: pagedkv always runs chunked prefill (it cannot be turned off)")
        setattr(namespace, self.dest, True)


def add_engine_arguments(parser: argparse.ArgumentParser, *, prefix_caching: bool) -> None:
    """The engine's flags on ``parser``; ``prefix_caching``: that flag's default (serve: on, as vLLM)."""
    a = parser.add_argument
    a("--model", default=None,
      help="local HF model dir, .gguf, or cached hub id org/name (default: the bundled SmolLM2-135M-Instruct, "
      "a Q4_1 GGUF de-quantized on load)%(default).0s")
    a("--revision", default=None, help="branch, tag or commit of a cached hub model (default: %(default)s)")
    a("--model-impl", default="auto", choices=["auto", "pagedkv", "vllm", "transformers"],
      help="model code: auto (pagedkv's own Llama where it computes exactly what transformers does, else "
      "transformers), pagedkv (alias vllm), or transformers (default: %(default)s)")
    a("--quantization", "-q", default=None, metavar="METHOD",
      help="gguf: run a .gguf file's Q8_0/Q4_0/Q4_1 weights as their blocks; int8 / int4: quantize a "
      "full-precision checkpoint at load (Q8_0 / Q4_1 blocks, group 32) (default: none, a GGUF file is "
      "de-quantized to float32; any other method is refused)%(default).0s")
    a("--backend", default="auto", help="attention backend: auto (cpu on CPU, else torch), cpu, torch, triton, cupy "
      "(default: %(default)s)")
    a("--allocator", default="paged", help="block allocator: paged, or static (baseline) (default: %(default)s)")
    a("--scheduler", default=None, metavar="NAME",
      help="scheduler by registered name, e.g. a third-party plugin's "
      "(default: fcfs, or --scheduling-policy's)%(default).0s")
    a("--scheduling-policy", default=None, choices=["fcfs", "priority"],
      help="vLLM's policy: fcfs, or priority (a request's lower 'priority' runs first) (default: fcfs)%(default).0s")
    a("--priority-aging-steps", type=int, default=100, metavar="STEPS",
      help="priority policy: steps a request waits to rank one priority level better, so a stream of "
      "better-priority requests cannot starve it; 0: strict priority, as vLLM (default: %(default)s)")
    a("--plugin-option", action="append", default=[], type=plugin_option, metavar="PLUGIN.KEY=VALUE",
      help="an option for a plugin, into plugin_options[PLUGIN][KEY]; VALUE is JSON or text (repeatable)")
    a("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory", default=None,
                        help="KV budget in bytes, e.g. 512MiB (default: 1GiB on CPU)%(default).0s")
    budget.add_argument("--num-blocks", "--num-gpu-blocks-override", dest="num_blocks", type=int, default=None,
                        help="KV budget in blocks (default: from --kv-cache-memory)%(default).0s")
    budget.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="CUDA only: the share of device memory to use, e.g. 0.9 (default: unset)%(default).0s")
    a("--max-model-len", type=model_len, default=None,
      help="longest prompt + answer: 4096, 32k (=32000), 32K (=32768), or auto (what the cache holds); "
      "start-up fails if the cache cannot hold one request this long (default: the model's, capped by the cache)"
      "%(default).0s")
    a("--max-num-seqs", type=int, default=128, help="sequences in one step at most (default: %(default)s)")
    a("--max-num-batched-tokens", type=int, default=2048, help="tokens in one step at most (default: %(default)s)")
    a("--dtype", default="auto",
      help="auto (the checkpoint's; float16 becomes bfloat16 on CPU), float32, bfloat16, float16 (CUDA) "
      "(default: %(default)s; vLLM's is auto)")
    a("--kv-cache-dtype", default="auto",
      help="KV storage: auto (the model dtype), bfloat16, float16, int8, fp8_e4m3, fp8_e5m2 (default: %(default)s)")
    a("--device", default="auto", help="cpu, cuda or auto (default: %(default)s)")
    a("--seed", type=int, default=0, help="the engine's random seed (default: %(default)s)")
    a("--tensor-parallel-size", "-tp", type=int, default=1, help="shard the model over N processes "
      "(default: %(default)s)")
    a("--threads", type=int, default=None,
      help="torch CPU threads (default: torch's choice; 1 is faster on a busy shared machine)%(default).0s")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=prefix_caching,
      help="reuse KV blocks of shared prefixes (default: %(default)s)")
    a("--enable-copy-on-write", action="store_true", help="n > 1 samples share prompt blocks (default: off)")
    a("--swap-space", type=swap_size, default=None,
      help="CPU swap space for preempted requests: a number is GiB (as vLLM), or a size such as 512MiB "
      "(default: none)%(default).0s")
    a("--enable-chunked-prefill", "--no-enable-chunked-prefill", action=_RefuseNo, default=True,
      help="accepted for vLLM compatibility: pagedkv always chunks long prompts (default: on, always)")
    a("--enforce-eager", action="store_true",
      help="accepted for vLLM compatibility: pagedkv never captures graphs, so it always runs eagerly")
    a("--telemetry", default=None, metavar="ADDR",
      help="stream block/request telemetry to unix:PATH or tcp:127.0.0.1:PORT "
      "(engine monitor --connect ADDR) (default: off)%(default).0s")
    a("--trace", default=None, metavar="FILE",
      help="record the telemetry stream to FILE (NDJSON) (default: off)%(default).0s")
    a("--structured-outputs-backend", default="guidance",
      help="grammar backend for response_format / structured_outputs (guidance: llguidance, built in; or a "
      "plugin's) (default: %(default)s)")
    add_grammar_arguments(a)


def add_grammar_arguments(a: Any) -> None:
    """Bounds on grammar work, so one client's constraints cannot stall or bloat the server (issue 42)."""
    a("--grammar-compile-workers", type=int, default=2,
      help="threads compiling constraints; one client holds at most all but one (default: %(default)s)")
    a("--grammar-compile-timeout", type=float, default=10.0, metavar="SECONDS",
      help="a constraint still compiling after this answers 400 (default: %(default)s)")
    a("--max-grammar-bytes", type=human_int, default=128 * 1024,
      help="a constraint (schema, regex, grammar, choices) over this many bytes answers 400 (default: %(default)s)")
    a("--grammar-cache-bytes", type=byte_size, default=32 * 2**20,
      help="compiled grammars kept, by estimated memory, e.g. 256MiB (default: 32MiB; vLLM keeps 512MiB)%(default).0s")


def engine_config(args: argparse.Namespace) -> Any:
    """The :class:`EngineConfig` the parsed flags describe (checked there)."""
    from pagedkv.core.config import EngineConfig

    if args.scheduler and args.scheduling_policy and args.scheduler != args.scheduling_policy:
        raise ConfigError(f"--scheduler {args.scheduler} and --scheduling-policy {args.scheduling_policy} disagree; "
                          "give one")
    options: dict[str, dict[str, Any]] = {}
    for plugin, key, value in args.plugin_option or ():
        options.setdefault(plugin, {})[key] = value
    return EngineConfig(
        model=args.model, revision=args.revision, model_impl=args.model_impl, backend=args.backend,
        quantization=args.quantization,
        allocator=args.allocator,
        scheduler=args.scheduler or args.scheduling_policy or "fcfs", block_size=args.block_size,
        priority_aging_steps=args.priority_aging_steps,
        kv_cache_memory=args.kv_cache_memory, num_blocks=args.num_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=args.enable_prefix_caching, enable_copy_on_write=args.enable_copy_on_write,
        swap_space=args.swap_space, telemetry=getattr(args, "telemetry", None), trace=getattr(args, "trace", None),
        plugin_options=options, structured_outputs_backend=args.structured_outputs_backend,
        grammar_compile_workers=args.grammar_compile_workers, grammar_compile_timeout=args.grammar_compile_timeout,
        max_grammar_bytes=args.max_grammar_bytes, grammar_cache_bytes=args.grammar_cache_bytes,
    )


def take_positional_model(args: argparse.Namespace) -> None:
    """``engine serve MODEL`` (vLLM's spelling) is ``--model MODEL``; both, naming different models, is an error."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ConfigError(f"the model is given twice: {tag!r} and --model {args.model!r}")
        args.model = tag
