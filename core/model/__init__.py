"""The model: found and loaded offline, checked for support, run on one packed batch per step.

``model_loader`` and ``hub_cache`` (local files and the local HF cache only), ``model_support``
(refuse by name what would run wrongly), ``model_runner`` (one forward per step),
``hf_attention`` (the bridge transformers calls in every layer), ``cpu_linear`` (packed
oneDNN linears on CPU); pagedkv's own Llama without transformers: ``llama_model`` (the module),
``native_config`` (which checkpoints it runs exactly), ``native_loader`` + ``safetensors_mmap``
(weights), ``gguf_loader`` + ``quant_linear`` + ``quant_formats`` (a GGUF file's blocks kept
quantized: ``quantization="gguf"``), ``fast_tokenizer`` + ``chat_render`` (the tokenizer on ``tokenizers``
and ``jinja2``).
Imports ``kv/``, ``sample/``, ``sched/`` and the foundation modules.
"""
