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
# OUT_DIR/{base,lora}-one-<pair>.json and {base,lora}-32-<round>/, prints each
# ratio, then their medians.
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

adapters() {  # kind: the bench's flags that spread the requests over the adapters
    [ "$1" = lora ] && echo "--lora-modules $NAMES" || true
}

one_stream() {  # kind, port, output file: serve_workloads.sh's one-stream load, 8 requests
    # shellcheck disable=SC2046
    (cd "$REPO" && "$PY" -m pagedserve bench serve --base-url "http://127.0.0.1:$2" --seed 0 \
        --timeout 1800 --quiet --dataset random --random-input-len 128 --random-output-len 64 \
        --num-prompts 8 --max-concurrency 1 $(adapters "$1") --output "$3") >/dev/null
}

many_streams() {  # kind, port, output folder: serve_workloads.sh's own 32-streams run
    BENCH_FLAGS="$(adapters "$1")" bash "$REPO/scripts/serve_workloads.sh" "http://127.0.0.1:$2" "$3" \
        32-streams >/dev/null
}

start base "$PORT"
start lora "$((PORT + 1))"
for i in $(seq "$PAIRS"); do
    one_stream base "$PORT" "$OUT/base-one-$i.json"
    one_stream lora "$((PORT + 1))" "$OUT/lora-one-$i.json"
done
for i in $(seq "$ROUNDS"); do
    many_streams base "$PORT" "$OUT/base-32-$i"
    many_streams lora "$((PORT + 1))" "$OUT/lora-32-$i"
done

"$PY" - "$OUT" "$PAIRS" "$ROUNDS" <<'PYEOF'
import json, statistics, sys
from pathlib import Path
out, pairs, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def summary(path):
    return json.loads((out / path).read_text())["summary"]
def line(title, path, by, key, count, fmt):
    base = [key(summary(path.format(kind="base", i=i))) for i in range(1, count + 1)]
    lora = [key(summary(path.format(kind="lora", i=i))) for i in range(1, count + 1)]
    ratios = [a / b for a, b in zip(lora, base)]
    print(f"{title}: base {fmt(statistics.median(base))}, adapters {fmt(statistics.median(lora))}; "
          f"adapters / base by {by}: "
          + " ".join(f"{x:.3f}" for x in ratios) + f"; median {statistics.median(ratios):.3f}")
line("one stream, median ITL", "{kind}-one-{i}.json", "pair", lambda s: s["itl_s"]["median"], pairs, lambda v: f"{v * 1e3:.2f} ms")
line("32 streams, output tok/s", "{kind}-32-{i}/32-streams.json", "round", lambda s: s["output_throughput"], rounds, lambda v: f"{v:.1f}")
PYEOF
