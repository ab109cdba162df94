# Set-up and the two commands of the README. Every target creates or reuses the virtual
# environment in $(VENV) and installs what it needs.
#
#   make demo   # tether train on the embedded default task (CPU, minutes)
#   make test   # the test suite
#
# PyTorch comes first: without a GPU, the CPU build (torch==$(TORCH_VERSION)); set
# TORCH_INDEX=https://download.pytorch.org/whl/cpu where the CPU wheel is not on a local index.
# With an NVIDIA GPU (nvidia-smi present) or GPU=1: the default CUDA build and the vllm extra.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
GPU ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1 || echo 0)
EXTRAS := test$(if $(filter 1,$(GPU)),$(comma)vllm,)
comma := ,

.PHONY: install demo test test-fast bench lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

demo: install
	$(BIN)/tether train $(ARGS)

# the tests also need the ray extra (trainer.backend=ray is tested against a real local Ray)
$(VENV)/.installed-ray: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS),ray]"
	touch $@

test: install $(VENV)/.installed-ray
	RAY_AUTH_MODE=disabled $(BIN)/python -m pytest -q

test-fast: install $(VENV)/.installed-ray
	RAY_AUTH_MODE=disabled $(BIN)/python -m pytest -q -m "not slow"

bench: install
	$(BIN)/python benchmarks/bench_gae.py
	$(BIN)/python benchmarks/bench_logprobs.py
	$(BIN)/python benchmarks/bench_train.py

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
