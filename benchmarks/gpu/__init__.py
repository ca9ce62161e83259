"""Parts of ``benchmarks/gpu/gpu_suite.py``: the one-shot GPU check (see that script's docstring)."""
