#!/usr/bin/env bash
# LoRA serving against the base alone, side by side (#55's benchmark).
#
#   bash scripts/lora_serve_bench.sh OUT_DIR [ROUNDS] [SERVE FLAGS ...]
#
# Makes 8 random rank-16 adapters on every projection of the default model
# (scripts/make_lora_adapters.py) and starts two servers: the base alone
# (`pagedserve serve`) and the base with the 8 adapters (`--enable-lora
# --max-loras 8 --lora-modules ...`). Both stay up, and only one is ever busy
# (an idle server sleeps: 0.4 % of a core), so the runs can alternate in
# short pairs: the VM's drift (a base ITL that moves 7.6-10.7 ms within ten
# minutes) then falls on both sides of a pair, where one server at a time,
# minutes apart, let it into the ratio.
#   one stream   PAIRS pairs (default 12) of 8 requests, 128 in / 64 out, one
#                at a time, base then adapters: the ratio of median ITLs, pair by pair
#   32 streams   ROUNDS rounds (default 2) of serve_workloads.sh's 32-streams load
#                (64 requests, 128 in / 64 out), base then adapters: the ratio
#                of output tok/s, round by round
# On the adapters' server the requests take the 8 adapters in turn. Writes
# OUT_DIR/{base,lora}-*.json and prints each ratio, then their medians.
set -euo pipefail
OUT="${1:?usage: $0 OUT_DIR [ROUNDS] [SERVE FLAGS ...]}"
ROUNDS="${2:-2}"
PAIRS="${PAIRS:-12}"
shift $(( $# >= 2 ? 2 : 1 ))
EXTRA=("$@")  # more `pagedserve serve` flags, for both servers
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$REPO/.venv/bin/python}"
PORT="${PORT:-8123}"
mkdir -p "$OUT"
MODULES=$(cd "$REPO" && "$PY" scripts/make_lora_adapters.py "$OUT/adapters" | tail -1)
NAMES=$(for m in $MODULES; do printf '%s ' "${m%%=*}"; done)
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT

start() {  # kind, port
    local flags=()
    [ "$1" = lora ] && flags=(--enable-lora --max-loras 8 --lora-modules $MODULES)
    (cd "$REPO" && exec "$PY" -m pagedserve serve --port "$2" "${flags[@]}" ${EXTRA[@]+"${EXTRA[@]}"} >"$OUT/$1.log" 2>&1) &
    PIDS+=($!)
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$2/health" >/dev/null && return
        kill -0 "${PIDS[-1]}" 2>/dev/null || { echo "server died: $OUT/$1.log" >&2; exit 1; }
        sleep 0.5
    done
    echo "server not ready: $OUT/$1.log" >&2; exit 1
}

bench() {  # kind, port, output file, then bench serve's workload flags
    local kind=$1 port=$2 out=$3 bench=()
    shift 3
    [ "$kind" = lora ] && bench=(--lora-modules $NAMES)
    (cd "$REPO" && "$PY" -m pagedserve bench serve --base-url "http://127.0.0.1:$port" --seed 0 \
        --timeout 1800 --quiet "$@" ${bench[@]+"${bench[@]}"} --output "$out") >/dev/null
}

start base "$PORT"
start lora "$((PORT + 1))"
ONE=(--dataset random --random-input-len 128 --random-output-len 64 --num-prompts 8 --max-concurrency 1)
MANY=(--dataset random --random-input-len 128 --random-output-len 64 --num-prompts 64 --max-concurrency 32)
for i in $(seq "$PAIRS"); do
    bench base "$PORT" "$OUT/base-one-$i.json" "${ONE[@]}"
    bench lora "$((PORT + 1))" "$OUT/lora-one-$i.json" "${ONE[@]}"
done
for i in $(seq "$ROUNDS"); do
    bench base "$PORT" "$OUT/base-32-$i.json" "${MANY[@]}"
    bench lora "$((PORT + 1))" "$OUT/lora-32-$i.json" "${MANY[@]}"
done

"$PY" - "$OUT" "$PAIRS" "$ROUNDS" <<'PYEOF'
import json, statistics, sys
from pathlib import Path
out, pairs, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def summary(name):
    return json.loads((out / f"{name}.json").read_text())["summary"]
def line(title, tag, by, key, count, fmt):
    base = [key(summary(f"base-{tag}-{i}")) for i in range(1, count + 1)]
    lora = [key(summary(f"lora-{tag}-{i}")) for i in range(1, count + 1)]
    ratios = [a / b for a, b in zip(lora, base)]
    print(f"{title}: base {fmt(statistics.median(base))}, adapters {fmt(statistics.median(lora))}; "
          f"adapters / base by {by}: "
          + " ".join(f"{x:.3f}" for x in ratios) + f"; median {statistics.median(ratios):.3f}")
line("one stream, median ITL", "one", "pair", lambda s: s["itl_s"]["median"], pairs, lambda v: f"{v * 1e3:.2f} ms")
line("32 streams, output tok/s", "32", "round", lambda s: s["output_throughput"], rounds, lambda v: f"{v:.1f}")
PYEOF
