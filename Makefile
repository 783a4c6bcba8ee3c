# `make train` and `make test` are the two commands a newcomer runs; both install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/tiny.yaml
TRAIN_ARGS ?=
BENCH_ARGS ?=
# 8 fake CPU devices so the data-parallel and ZeRO paths run on any laptop (tests/conftest.py adds the rest of
# the tests' XLA flags: tests/xla_flags.py).
TEST_ENV := XLA_FLAGS=--xla_force_host_platform_device_count=8 WANDB_MODE=disabled JAX_PLATFORMS=cpu

.PHONY: install install-test train lint test test-fast bench clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -e .
	touch $@

# The test extra: pytest, shellcheck, ruff, mypy, PyTorch (CPU) + transformers to check the Hugging Face export, the
# openai client and Playwright for `zerolm serve`; and a browser for its page: Debian's chromium, where none is installed.
install-test: $(VENV)/.installed-test

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test]'
	command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
		{ $$(command -v sudo) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$(command -v sudo) apt-get install -y -qq chromium; }
	touch $@

# Trains, then draws the run's curves (loss, tokens/s, MFU, lr) and prints the PNG's path.
train: install
	$(PY) main_zero.py --config $(CONFIG) --plot $(TRAIN_ARGS)

# Lint and import order (ruff) on the whole tree, types (mypy) on src/: CI fails on either before any test runs.
lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The whole suite on two xdist workers, one test file each at a time, the longest first (docs/testing.md: its time as
# measured on 2 cores; a third worker measured no faster).
test: lint
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

# The unit tier for your own iterations: no training runs in subprocesses, no TPU compiles, no multi-process runs,
# no sweeps of the sharded step over layouts (those are marked `slow`).
test-fast: install-test
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow" tests

# The ZeRO-1 step against the naive single-jit step on 8 fake CPU devices (BENCHMARKS.md); BENCH_ARGS adds options
# (`--steps 3`, `--set model.n_layer=2`). The benchmarks run as modules from the repository's root: benchmarks/README.md.
bench: install
	$(TEST_ENV) $(PY) -m benchmarks.measure.zero_step --config $(CONFIG) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
