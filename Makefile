# fmkv: `make demo` runs the main job on its embedded default; `make test` runs every test.
# Both create .venv and install what they need (cmake, ninja, numpy, pytest via pip; GoogleTest
# via apt when missing and we are root).
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
	$(PY) -m pip install -q cmake ninja numpy pytest scikit-build-core nanobind
	touch $@

deps: $(VENV)/.stamp
	@if [ ! -e /usr/include/gtest/gtest.h ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq libgtest-dev >/dev/null; \
	  else echo "GoogleTest missing: install libgtest-dev (Debian/Ubuntu) or googletest"; exit 1; fi; fi

build: deps
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(CMAKE) -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(CMAKE) --build $(BUILD) -j $(JOBS)

demo: build
	$(BUILD)/cli/fmkv info
	$(BUILD)/cli/fmkv demo

test-cpp: build
	cd $(BUILD) && PATH=$(CURDIR)/$(VENV)/bin:$$PATH ctest --output-on-failure -j $(JOBS)

test-python: deps
	$(PY) -m pip install -q .
	cd tests/python && ../../$(PY) -m pytest -q .

test: test-cpp test-python

bench-cpu: build
	$(PY) bench/cpu_bench.py

clean:
	rm -rf $(BUILD) $(VENV)
