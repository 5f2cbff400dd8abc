# All set-up happens here: `make test` and `make demo` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The development environment pins the CPU build of torch that lies on disk;
# the package itself accepts any recent torch (GPU users bring their own).
TORCH_PIN ?= torch==2.13.0

.PHONY: setup test demo bench clean

$(BIN)/moe-offload: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

setup: $(BIN)/moe-offload

test: setup
	$(BIN)/python -m pytest tests

demo: setup
	$(BIN)/python benchmarks/demo.py

bench: setup
	$(BIN)/python benchmarks/plan_scale.py
	$(BIN)/python benchmarks/policy_compare.py

clean:
	rm -rf $(VENV) build demo-out
