#!/usr/bin/env bash
# Speculative decoding on and off, served, on the grounded and open-chat workloads.
#
#   bash scripts/spec_side_by_side.sh OUT_DIR
#
# BENCHMARK-ONLY. One server at a time, ROUNDS times (default 2) in turn
# (A B C A B C): pagedserve without speculation ("off"), with the n-gram
# proposer ("ngram", $NGRAM) and with suffix decoding ("suffix"), and, when
# LLAMA_SERVER names a llama-server binary, llama.cpp on the same GGUF without
# ("llama") and with its n-gram speculation ("llama-ngram", $LLAMA_SPEC).
# Against each, `pagedserve bench serve` runs the grounded set with one stream
# (16 chats), the open-chat set with one stream (8 chats), then both sets with
# 32 streams (32 chats each); greedy, answers end at EOS or 256 tokens.
# Results: OUT_DIR/<engine>-<workload>-r<round>.json (bench serve --output).
# Environment: ENGINES, ROUNDS, PORT, NGRAM, SUFFIX, LLAMA_SERVER, LLAMA_SPEC, ARGS
# (extra pagedserve serve flags).
set -euo pipefail
OUT="${1:?usage: $0 OUT_DIR}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$REPO/.venv/bin/python"
ROUNDS="${ROUNDS:-2}"
PORT="${PORT:-8021}"
NGRAM="${NGRAM:-{\"method\": \"ngram\", \"num_speculative_tokens\": 6, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5\}}"
SUFFIX="${SUFFIX:-{\"method\": \"suffix\", \"num_speculative_tokens\": 8\}}"
LLAMA_SPEC="${LLAMA_SPEC:---spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 6}"
DEFAULT_ENGINES="off ngram suffix"
[ -n "${LLAMA_SERVER:-}" ] && DEFAULT_ENGINES="$DEFAULT_ENGINES llama llama-ngram"
ENGINES="${ENGINES:-$DEFAULT_ENGINES}"
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" >&2; }

command_for() {  # engine -> the server's command line in CMD
    case "$1" in
        off) CMD=("$PY" -m pagedserve serve --port "$PORT" ${ARGS:-}) ;;
        ngram) CMD=("$PY" -m pagedserve serve --port "$PORT" ${ARGS:-} --speculative-config "$NGRAM") ;;
        suffix) CMD=("$PY" -m pagedserve serve --port "$PORT" ${ARGS:-} --speculative-config "$SUFFIX") ;;
        llama|llama-ngram)
            gguf="$(find "$REPO/.venv" -name 'SmolLM2-135M-Instruct.Q4_1.gguf' | head -1)"
            CMD=("$LLAMA_SERVER" -m "$gguf" --host 127.0.0.1 --port "$PORT" --alias smollm2
                 --parallel 32 --cont-batching -c 16384 -t 2 -tb 2 --jinja)
            # shellcheck disable=SC2206
            if [ "$1" = llama-ngram ]; then CMD+=($LLAMA_SPEC); fi ;;
    esac
}

bench() {  # engine round workload streams prompts
    (cd "$REPO" && "$PY" -m pagedserve bench serve --base-url "http://127.0.0.1:$PORT" \
        --seed "$2" --dataset "$3" --max-concurrency "$4" --num-prompts "$5" \
        --chat-max-tokens 256 --output "$OUT/$1-$3-$4s-r$2.json" --quiet) >&2 \
        || log "bench serve failed: $1 $3 $4"
}

for round in $(seq 1 "$ROUNDS"); do
    for engine in $ENGINES; do
        log "$engine round $round (load $(cut -d' ' -f1-3 /proc/loadavg))"
        while curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null 2>&1; do
            log "port $PORT still answers: waiting for the last server to go"; sleep 2
        done
        command_for "$engine"
        # setsid from a background job execs in place: $! is the server, the leader
        # of its own process group, so the kill below takes it and its children.
        setsid "${CMD[@]}" > "$OUT/$engine-r$round-server.log" 2>&1 &
        server=$!
        for _ in $(seq 1 300); do
            curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null 2>&1 && break
            kill -0 "$server" 2> /dev/null || { log "$engine did not start"; break; }
            sleep 1
        done
        bench "$engine" "$round" grounded 1 16
        bench "$engine" "$round" open-chat 1 8
        bench "$engine" "$round" grounded 32 32
        bench "$engine" "$round" open-chat 32 32
        kill -TERM -- "-$server" 2> /dev/null || true
        wait "$server" 2> /dev/null || true
    done
done
log "done"
