#!/usr/bin/env bash
# The four serving workloads of the vLLM comparison, against one server.
#
#   bash scripts/serve_workloads.sh URL OUT_DIR [WORKLOAD ...]
#
# Start the server first (`pagedserve serve`, or `scripts/vllm_cpu_peer.sh
# serve`), one at a time: two servers on a small machine measure each other.
# Each workload writes OUT_DIR/<name>.json (`pagedserve bench serve
# --output`); the last lines print the table of docs/performance.md.
# BENCH_FLAGS: more flags for every run (`--lora-modules lora0 lora1 ...`: the
# requests take the server's adapters in turn).
#
#   one-stream   1 stream, 128 in / 64 out, 16 requests         median ITL
#   32-streams   32 streams, 128 in / 64 out, 64 requests       output tok/s, median TTFT
#   shared       8 streams, 2 shared 512-token system prompts
#                + 32 tokens, 16 out, 32 requests               output tok/s
#   128-streams  128 streams, 128 in / 256 out, 128 requests    output tok/s
set -euo pipefail
URL="${1:?usage: $0 URL OUT_DIR [WORKLOAD ...]}"
OUT="${2:?usage: $0 URL OUT_DIR [WORKLOAD ...]}"
shift 2
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$REPO/.venv/bin/python}"
WORKLOADS=("$@")
[ ${#WORKLOADS[@]} -gt 0 ] || WORKLOADS=(one-stream 32-streams shared 128-streams)
mkdir -p "$OUT"

args_of() {
    case "$1" in
        one-stream) echo "--dataset random --random-input-len 128 --random-output-len 64 --num-prompts 16 --max-concurrency 1" ;;
        32-streams) echo "--dataset random --random-input-len 128 --random-output-len 64 --num-prompts 64 --max-concurrency 32" ;;
        shared) echo "--dataset prefix-repetition --num-prefixes 2 --prefix-len 512 --suffix-len 32 --output-len 16 --num-prompts 32 --max-concurrency 8" ;;
        128-streams) echo "--dataset random --random-input-len 128 --random-output-len 256 --num-prompts 128 --max-concurrency 128" ;;
        *) echo "unknown workload $1" >&2; exit 2 ;;
    esac
}

for name in "${WORKLOADS[@]}"; do
    echo "== $name" >&2
    # shellcheck disable=SC2046
    (cd "$REPO" && "$PY" -m pagedserve bench serve --base-url "$URL" --seed 0 --timeout 1800 \
        $(args_of "$name") ${BENCH_FLAGS:-} --output "$OUT/$name.json")
done

"$PY" - "$OUT" "${WORKLOADS[@]}" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
# TPOT beside ITL: a server that holds back a token until its text is whole
# UTF-8 (llama-server does) streams fewer chunks than tokens, and ITL is per
# chunk; TPOT, (E2E - TTFT) / (tokens - 1), is per token whatever the chunking.
print("| workload | output tok/s | median TTFT ms | median TPOT ms | median ITL ms | chunks a request | failed |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for name in sys.argv[2:]:
    run = json.loads((out / f"{name}.json").read_text())
    s, done = run["summary"], [r for r in run["per_request"] if r["ok"]]
    chunks = sum(len(r["itl"]) + 1 for r in done) / max(1, len(done))
    print(f"| {name} | {s['output_throughput']:.1f} | {s['ttft_s']['median'] * 1e3:.0f} "
          f"| {s['tpot_s']['median'] * 1e3:.1f} | {s['itl_s']['median'] * 1e3:.1f} | {chunks:.1f} | {s['failed']} |")
EOF
