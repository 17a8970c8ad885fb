#!/usr/bin/env bash
# LoRA serving against the base alone, side by side (#55's benchmark).
#
#   bash scripts/lora_serve_bench.sh OUT_DIR [ROUNDS] [SERVE FLAGS ...]
#
# Makes 8 random rank-16 adapters on every projection of the default model
# (scripts/make_lora_adapters.py), then alternates two servers, one at a
# time: the base alone (`pagedserve serve`) and the base with the 8 adapters
# (`--enable-lora --max-loras 8 --lora-modules ...`), each running the
# one-stream and 32-streams workloads of scripts/serve_workloads.sh; on the
# adapters' server the requests take the 8 adapters in turn. Writes
# OUT_DIR/{base,lora}-<round>/ and prints one table row per run.
set -euo pipefail
OUT="${1:?usage: $0 OUT_DIR [ROUNDS] [SERVE FLAGS ...]}"
ROUNDS="${2:-2}"
shift $(( $# >= 2 ? 2 : 1 ))
EXTRA=("$@")  # more `pagedserve serve` flags, for both servers
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$REPO/.venv/bin/python}"
PORT="${PORT:-8123}"
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"
MODULES=$(cd "$REPO" && "$PY" scripts/make_lora_adapters.py "$OUT/adapters" | tail -1)
NAMES=$(for m in $MODULES; do printf '%s ' "${m%%=*}"; done)

serve_and_measure() {  # kind, round
    local kind=$1 dir="$OUT/$1-$2" flags=()
    [ "$kind" = lora ] && flags=(--enable-lora --max-loras 8 --lora-modules $MODULES)
    (cd "$REPO" && exec "$PY" -m pagedserve serve --port "$PORT" "${flags[@]}" ${EXTRA[@]+"${EXTRA[@]}"} >"$OUT/$kind-$2.log" 2>&1) &
    local pid=$!
    for _ in $(seq 600); do
        curl -sf "$URL/health" >/dev/null && break
        kill -0 "$pid" 2>/dev/null || { echo "server died: $OUT/$kind-$2.log" >&2; exit 1; }
        sleep 0.5
    done
    local bench=""
    [ "$kind" = lora ] && bench="--lora-modules $NAMES"
    BENCH_FLAGS="$bench" bash "$REPO/scripts/serve_workloads.sh" "$URL" "$dir" one-stream 32-streams \
        | sed "s/^| \(one-stream\|32-streams\)/| $kind $2 \1/"
    kill "$pid"; wait "$pid" 2>/dev/null || true
}

for round in $(seq "$ROUNDS"); do
    serve_and_measure base "$round"
    serve_and_measure lora "$round"
done
