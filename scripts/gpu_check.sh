#!/usr/bin/env bash
# GPU acceptance run:  bash scripts/gpu_check.sh OUTDIR
#
# For a CUDA machine with torch, triton and transformers but none of our other
# packages and no internet: nothing is installed, the repo is used in place
# (PYTHONPATH=.).  Steps, each logged to OUTDIR/<step>.log:
#   1. env           versions and nvidia-smi
#   2. kernel-tests  tests/kernels on CUDA (native Triton, not the interpreter);
#                    without pytest, the same cases through the standalone runner
#   3. kernel-bench  bench/kernels/kernels.py sweep -> OUTDIR/kernels.json
#   4. e2e           python -m bench.gpu.gpu_check --output OUTDIR/e2e.json (if present)
#   5. graphs-tests  tests/engine/test_cuda_graphs.py (its CUDA test replays real graphs)
#   6. graphs-parity python -m bench.gpu.gpu_graphs --parts parity: CUDA graphs for the decode
#                    step, eager vs graphs greedy tokens in float32 -> OUTDIR/graphs-parity.json
#   7. graphs-speed  python -m bench.gpu.gpu_graphs --parts speed: one-stream ITL at Llama-3.1-8B's
#                    shape against the HBM floor, 64/256-stream throughput, eager vs graphs
#                    -> OUTDIR/graphs-speed.json (a process of its own: a fault in one part
#                    cannot take the other with it)
# Every step runs even if an earlier one fails; OUTDIR/summary.txt lists the
# exit codes and the script exits non-zero if any step failed.
# GPU_CHECK_STEPS="env kernel-tests graphs-parity" runs only the steps named (default: all).
set -u -o pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0

# step NAME CMD...: run CMD with its output in OUTDIR/NAME.log, record the exit code.
step() {
    local name=$1
    shift
    if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then
        return 0
    fi
    echo "== $name: $*"
    local start=$SECONDS
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc ($((SECONDS - start)) s) log: $OUT/$name.log" | tee -a "$SUMMARY"
    if [ $rc -ne 0 ]; then
        FAILED=1
        tail -n 20 "$OUT/$name.log"
    fi
}

env_report() {
    "$PY" - <<'PYEOF'
import importlib, sys
print("python", sys.version)
for name in ("torch", "triton", "transformers", "pytest", "tqdm", "msgspec", "jinja2"):
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError:
        print(name, "not installed")
import torch
print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
PYEOF
    nvidia-smi || true
}

kernel_tests() {
    if "$PY" -c "import pytest" 2>/dev/null; then
        # --confcutdir: only tests/kernels/conftest.py, not the engine fixtures
        # (which want model files this machine may not have).
        PAGEDSERVE_TEST_DEVICE=cuda "$PY" -m pytest tests/kernels -q -rf \
            --confcutdir=tests/kernels -p no:cacheprovider --junitxml="$OUT/kernel-tests.xml"
    else
        echo "pytest not installed: running the Triton cases through the standalone runner"
        "$PY" tests/kernels/kernel_subprocess.py --device cuda --output "$OUT/kernel-cases.json"
    fi
}

e2e() {
    if [ -f bench/gpu/gpu_check.py ]; then
        "$PY" -m bench.gpu.gpu_check --output "$OUT/e2e.json"
    else
        echo "bench/gpu/gpu_check.py not present: end-to-end check not run"
        return 3
    fi
}

graphs_tests() {
    if "$PY" -c "import pytest" 2>/dev/null; then
        "$PY" -m pytest tests/engine/test_cuda_graphs.py -q -rfs -p no:cacheprovider \
            "tests/engine/test_async_scheduling.py::test_cuda_eager_graphs_and_graphs_with_async_give_the_same_tokens"
    else
        echo "pytest not installed: the graphs' tests not run (bench.gpu.gpu_graphs still checks parity)"
        return 3
    fi
}

step env env_report
step kernel-tests kernel_tests
step kernel-bench "$PY" -m bench.kernels.kernels --output "$OUT/kernels.json"
step e2e e2e
step graphs-tests graphs_tests
step graphs-parity "$PY" -m bench.gpu.gpu_graphs --parts parity --output "$OUT/graphs-parity.json"
step graphs-speed "$PY" -m bench.gpu.gpu_graphs --parts speed --output "$OUT/graphs-speed.json"

echo "summary: $SUMMARY"
exit $FAILED
