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

.PHONY: install demo test test-fast bench bench-peer lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

demo: install
	$(BIN)/tether train $(ARGS)

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

bench: install
	$(BIN)/python benchmarks/bench_gae.py
	$(BIN)/python benchmarks/bench_logprobs.py
	$(BIN)/python benchmarks/bench_train.py

# TRL 1.16 in a venv of its own (never in the default install): torch first, then trl, then this
# tether; fails if installing trl changed torch. Then the side-by-side benchmark of issue 13.
TRL_VENV ?= .venv-trl
TRL_VERSION ?= 1.16.0
$(TRL_VENV)/.installed: pyproject.toml Makefile
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
	$(TRL_VENV)/bin/python -c "import torch; print(torch.__version__)" > $(TRL_VENV)/.torch-before
	$(TRL_VENV)/bin/python -m pip install -q "trl==$(TRL_VERSION)" "torch==$(TORCH_VERSION)"
	$(TRL_VENV)/bin/python -m pip install -q -e . "torch==$(TORCH_VERSION)"
	$(TRL_VENV)/bin/python -c "import torch; print(torch.__version__)" | cmp -s - $(TRL_VENV)/.torch-before \
		|| { echo "installing trl changed torch: $$(cat $(TRL_VENV)/.torch-before) -> $$($(TRL_VENV)/bin/python -c 'import torch; print(torch.__version__)')"; exit 1; }
	touch $@

bench-peer: $(TRL_VENV)/.installed
	$(TRL_VENV)/bin/python benchmarks/bench_peer_trl.py $(ARGS)

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
