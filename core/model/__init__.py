"""The model: found and loaded offline, checked for support, run on one packed batch per step.

``model_loader`` and ``hub_cache`` (local files and the local HF cache only), ``model_support``
(refuse by name what would run wrongly), ``model_runner`` (one forward per step),
``hf_attention`` (the bridge transformers calls in every layer) and ``cpu_linear`` (packed
oneDNN linears on CPU). Imports ``kv/``, ``sample/``, ``sched/`` and the foundation modules.
"""
