# Two commands for a fresh machine:  `make demo`  and  `make test`.
# `make demo` trains a tiny model on arithmetic with GRPO and simulates a 7B run; see runs/*/.
# Both create the virtual environment themselves. torch is installed first and
# pinned, so that on a CPU-only machine pip takes the local CPU wheel instead of
# resolving a multi-GB CUDA build; override TORCH on a GPU machine if you like.

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
EXTRAS ?= test
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: demo test venv clean

$(STAMP): pyproject.toml spec/pyproject.toml adapters/fsdp/pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet -e ".[$(EXTRAS)]" -e ./spec -e ./adapters/fsdp
	touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/asyncflow run examples/arithmetic_grpo.yaml --run-dir runs/arithmetic-grpo
	$(VENV)/bin/asyncflow sim examples/sim_7b.yaml trainer.total_steps=3 --run-dir runs/sim-7b --no-progress

test: $(STAMP)
	$(VENV)/bin/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
