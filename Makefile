# Two commands: `make test` and `make run`. Each sets up .venv on first use (torch comes from the
# package registry: several GB the first time, then cached by pip).
# `make test-oldest` runs the version-dependent tests (marker `floor`) in .venv-oldest on the declared floor
# (constraints/oldest.txt).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
OLDEST := constraints/oldest.txt
VENV_OLDEST  := .venv-oldest
STAMP_OLDEST := $(VENV_OLDEST)/.installed-stamp
# The real data shipped beside this checkout; without it the tasks download (CIFAR-10 via torchvision).
DATA   ?= $(wildcard ../shared/data)
CIFAR_ARG = $(if $(DATA),--data-dir $(DATA)/cifar10,)
RUN_ARGS ?= --preset tiny --trials 12

.PHONY: test test-fast test-oldest run setup clean peers

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

# The floor: exactly the versions in $(OLDEST), whatever newer ones the index serves.
$(STAMP_OLDEST): pyproject.toml $(OLDEST)
	$(PYTHON) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install --quiet --disable-pip-version-check -c $(OLDEST) -e '.[dev]'
	touch $(STAMP_OLDEST)

setup: $(STAMP)

# The suite in two passes: everything else spread over two processes (pytest-xdist), then the tests marked
# `serial` (they time something, so nothing else may run beside them) one at a time. Each pass prints its
# 15 slowest tests. docs/testing.md says what a test may cost.
PYTEST := -m pytest -q --durations=15
test: $(STAMP)
	$(BIN)/python $(PYTEST) -n 2 -m "not serial"
	$(BIN)/python $(PYTEST) -p no:xdist -m serial

# The fast tier, for every change: the tests marked with no tier (slow, serial, server, processes, browser), over
# two processes; at most 2 minutes here. tests/conftest.py's guard fails an unmarked test that starts a process or
# takes over 10 s, so the tier stays fast. `make test` stays the whole suite, which CI runs.
FAST := not (slow or serial or server or processes or browser)
test-fast: $(STAMP)
	$(BIN)/python $(PYTEST) -n 2 -m "$(FAST)"

# HEADSEARCH_FLOOR makes tests/test_versions.py check that the floor's versions are the ones installed.
# On the floor, only the tests marked `floor`: those whose outcome can depend on a dependency's version.
test-oldest: $(STAMP_OLDEST)
	HEADSEARCH_FLOOR=$(OLDEST) $(VENV_OLDEST)/bin/python $(PYTEST) -n 2 -m "floor and not serial"
	HEADSEARCH_FLOOR=$(OLDEST) $(VENV_OLDEST)/bin/python $(PYTEST) -p no:xdist -m "floor and serial"

run: $(STAMP)
	$(BIN)/headsearch run --task vit-cifar10 $(CIFAR_ARG) $(RUN_ARGS)

# Syne Tune, for `benchmarks/search_quality.py --peers moasha` only, without its declared dependencies: its
# xgboost pulls a CUDA 12 NCCL that overwrites the CUDA 13 one torch ships, and MOASHA's replay needs none of
# them but scikit-learn and psutil (benchmarks/peers.py). Hence no `[peers]` extra.
peers: $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps syne-tune==0.16.0
	$(BIN)/python -m pip install --quiet --disable-pip-version-check scikit-learn psutil

clean:
	rm -rf $(VENV) $(VENV_OLDEST) runs *.egg-info
