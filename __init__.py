"""pagedkv: a PagedAttention inference engine for Hugging Face causal LMs.

The public API mirrors vLLM's offline interface::

    from pagedkv import LLM, SamplingParams
    llm = LLM()  # SmolLM2-135M-Instruct, torch backend
    print(llm.generate(["Hello"], SamplingParams(max_tokens=16))[0].text)
"""

from __future__ import annotations

from pagedkv import openmp_env

openmp_env.apply()  # before anything imports torch: libgomp reads its wait policy once, when it loads

__version__ = "0.1.0"

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "__version__"]


def __getattr__(name: str):  # lazy, so `import pagedkv` stays cheap
    if name in ("LLM",):
        from pagedkv.core.llm import LLM

        return LLM
    if name == "Engine":
        from pagedkv.core.engine import Engine

        return Engine
    if name == "EngineConfig":
        from pagedkv.core.config import EngineConfig

        return EngineConfig
    if name == "SamplingParams":
        from pagedkv.core.sample.sampling_params import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from pagedkv.core.sched.sequence import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
