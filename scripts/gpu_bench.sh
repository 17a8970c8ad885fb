#!/usr/bin/env bash
# GPU benchmark at real sizes with random weights:  bash scripts/gpu_bench.sh OUTDIR
#
# For the lent GPU machine (its own torch/triton/transformers, no internet, no
# checkpoints): each shape is a config-only folder (scripts/make_shape_folder.py)
# served with --load-format dummy, so the numbers are the real shapes' speed.
#   1. offline throughput, chat workload, per shape   OUTDIR/<shape>.json
# Shapes: llama-3.1-8b, qwen3-8b, qwen3-moe-small (as scripts/make_shape_folder.py
# defines them; every one fits one 80 GB GPU in bf16).
set -uo pipefail
OUT="${1:-gpu-bench-out}"
PY="${PY:-python3}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."  # the repo, used in place: nothing is installed there
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
SHAPES="${SHAPES:-llama-3.1-8b qwen3-8b qwen3-moe-small}"
PROMPTS="${PROMPTS:-256}"
status=0
for shape in $SHAPES; do
    folder="$OUT/models/$shape"
    "$PY" scripts/make_shape_folder.py "$shape" "$folder" || { status=1; continue; }
    echo "== $shape"
    "$PY" -m pagedserve bench throughput --model "$folder" --load-format dummy \
        --dtype bfloat16 --workload chat --num-prompts "$PROMPTS" --skip-hf \
        --output "$OUT/$shape.json" || status=1
done
exit $status
