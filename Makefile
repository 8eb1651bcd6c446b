# TAG — set-up, demo and tests. Two commands do everything on a fresh machine:
#   make demo    create .venv if missing, install TAG, plan a real model on a shipped topology
#   make test    create/update .venv, lint, run the whole test suite
#   make docs    regenerate the tables of README.md and docs/benchmarks.md from evaluation/results
#   make gpu-check OUT=DIR   on a machine with one NVIDIA GPU and a CUDA torch (no venv needed):
#                microbenchmarks, eager vs tag execute vs prediction per workload, < 8 minutes; then
#                2 gloo ranks on the one GPU (dp, pp, tp, ZeRO-3, offload) and with 2+ GPUs NCCL
#                dp/pp/tp, training equal to single-process (alone: GPU_CHECK_ARGS=--only-multi-gpu;
#                fewer GPUs: a 'skipped' record)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch==2.13.0 (CPU build) is installed from the local wheel directory when present.
WHEELS ?= /opt/wheels
PIP_FLAGS := -q $(if $(wildcard $(WHEELS)),--find-links $(WHEELS),)
STAMP  := $(VENV)/.installed
DEMO_MODEL ?= gpt2:n_layer=4,n_embd=256,n_head=4,seq=128
DEMO_TOPOLOGY ?= topologies/tag-testbed.yaml
export HF_HUB_OFFLINE := 1
export WANDB_MODE ?= disabled

.PHONY: demo test lint install clean gpu-check docs

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install $(PIP_FLAGS) --upgrade pip
	$(PIP) install $(PIP_FLAGS) -e '.[test,ray]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tag inspect --model $(DEMO_MODEL) --batch 32
	$(VENV)/bin/tag plan --model $(DEMO_MODEL) --batch 32 --topology $(DEMO_TOPOLOGY) --out $(VENV)/demo-plan.json --force

lint: $(STAMP)
	$(VENV)/bin/ruff check tag data evaluation tests

test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=30 tests

docs: $(STAMP)
	$(PY) -m evaluation.report

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

OUT ?= gpu-check
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=. $(PYTHON) -m evaluation.gpu_check --out $(OUT) $(GPU_CHECK_ARGS)
