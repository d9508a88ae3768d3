# The README's two commands, `make demo` and `make test`, each set up from nothing.
# The environment lives in .venv; it is rebuilt when pyproject.toml changes.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "DynaTrain needs Python >= 3.11, found " + sys.version.split()[0]'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	@touch $@

# The main job. Until the local runner lands: a small job trains, switches layout live
# (checked bit for bit against PyTorch Distributed Checkpoint, compared with checkpoint-and-
# restart) and trains on; then the plan of a 1024-GPU Qwen3 job losing a pipeline stage.
demo: setup
	$(BIN)/dynatrain bench switch --model gpt-tiny --from dp=2,zero=1 --to tp=2,pp=2
	@echo
	$(BIN)/dynatrain plan --model qwen3-235b-a22b --from tp=4,pp=8,dp=32,ep=32,zero=1 --to tp=4,pp=7,dp=32,ep=32,zero=1

test: setup
	$(BIN)/python -m pytest

# Figures, not pass/fail on timing: plan quality (bytes, exact) and plan speed (seconds).
bench: setup
	$(BIN)/python benchmarks/plan_quality.py
	$(BIN)/python benchmarks/plan_speed.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
