# Two commands: `make test` and `make run`. Each sets up .venv on first use (torch comes from the
# package registry: several GB the first time, then cached by pip).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# The real data shipped beside this checkout; without it the tasks download (CIFAR-10 via torchvision).
DATA   ?= $(wildcard ../shared/data)
CIFAR_ARG = $(if $(DATA),--data-dir $(DATA)/cifar10,)
RUN_ARGS ?= --preset tiny --trials 12

.PHONY: test run setup clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

run: $(STAMP)
	$(BIN)/headsearch run --task vit-cifar10 $(CIFAR_ARG) $(RUN_ARGS)

clean:
	rm -rf $(VENV) runs *.egg-info
