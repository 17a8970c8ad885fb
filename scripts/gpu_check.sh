#!/usr/bin/env bash
# GPU acceptance run:  bash scripts/gpu_check.sh OUTDIR
#
# For a CUDA machine with torch, triton and transformers but none of our other
# packages and no internet: nothing is installed, the repo is used in place
# (PYTHONPATH=.; a package the box lacks, e.g. gguf, can be carried in on PYTHONPATH,
# which is kept).  Steps, each logged to OUTDIR/<step>.log:
#   1. env           versions and nvidia-smi
#   2. gemv-bench    python -m bench.gpu.gpu_gemv: the decode GEMV (kernels/gemv_triton.py)
#                    against cuBLAS at Llama-3.1-8B's shapes, 1-8 rows, each product checked
#                    -> OUTDIR/gemv.json
#   3. graphs-speed  python -m bench.gpu.gpu_graphs --parts speed: one-stream ITL at Llama-3.1-8B's
#                    shape against the HBM floor (and where the step's GPU time goes),
#                    64/256-stream throughput -> OUTDIR/graphs-speed.json (a process of its
#                    own: a fault in one part cannot take the other with it)
#   4. graphs-parity python -m bench.gpu.gpu_graphs --parts parity: eager, CUDA graphs and
#                    async scheduling, greedy tokens in float32 -> OUTDIR/graphs-parity.json
#   5. new-kernels   the Triton kernels that have only run under the interpreter (GGUF GEMM,
#                    multi-LoRA, int8 / fp8 KV caches, the GEMV, the element-wise ops): their
#                    test files only, on CUDA, one pytest a file side by side, each under
#                    `timeout` ${NEW_KERNELS_TIMEOUT:-240} s -> OUTDIR/new-kernels-<file>.xml
#   6. new-kernels-bench  python -m bench.gpu.gpu_kernels: their GB/s at Llama-3.1-8B's sizes,
#                    each row checked against the reference -> OUTDIR/new-kernels.json
#                    (under `timeout` ${NEW_KERNELS_BENCH_TIMEOUT:-180} s)
#   7. kernel-tests  tests/kernels on CUDA (native Triton, not the interpreter);
#                    without pytest, the same cases through the standalone runner
#                    (all of it: >140 s on an H100, and its CPU-only compiled-op tests
#                    need a compiler build)
#   8. kernel-bench  bench/kernels/kernels.py sweep -> OUTDIR/kernels.json
#   9. e2e           python -m bench.gpu.gpu_check --output OUTDIR/e2e.json (if present)
#  10. graphs-tests  tests/engine/test_cuda_graphs.py (its CUDA test replays real graphs)
# The steps of this turn's work come first: with little device time,
#   GPU_CHECK_STEPS="env gemv-bench graphs-speed graphs-parity new-kernels" bash scripts/gpu_check.sh OUT
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
for name in ("torch", "triton", "transformers", "pytest", "tqdm", "msgspec", "jinja2", "gguf", "numpy"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "(no __version__)"))
    except ImportError:
        print(name, "not installed")
try:  # every step imports it; since GGUF serving it needs gguf (pure Python: carry it in)
    import kernels
    print("kernels: imports")
except Exception as exc:
    print(f"kernels: DOES NOT IMPORT: {type(exc).__name__}: {exc}")
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
        # tests/ on the path: with --confcutdir, tests/conftest.py (which puts it
        # there) is not loaded, and the kernel tests import tests/need.py.
        PAGEDSERVE_TEST_DEVICE=cuda PYTHONPATH="tests:$PYTHONPATH" "$PY" -m pytest tests/kernels -q -rf \
            --confcutdir=tests/kernels -p no:cacheprovider --junitxml="$OUT/kernel-tests.xml"
    else
        echo "pytest not installed: running the Triton cases through the standalone runner"
        "$PY" tests/kernels/kernel_subprocess.py --device cuda --output "$OUT/kernel-cases.json"
    fi
}

# The new Triton kernels' test files, and nothing else of tests/kernels: no CPU-only
# compiled-op test (they build the C++ ops), none of the Triton cases a GPU already passed.
# NEW_KERNEL_TESTS="file ..." runs those instead.
NEW_KERNEL_TESTS=${NEW_KERNEL_TESTS:-"tests/kernels/test_gemv_triton.py tests/kernels/test_elementwise_triton.py
    tests/kernels/test_quant_linear_triton.py
    tests/kernels/test_lora_triton.py tests/kernels/test_kv_int8_triton.py tests/kernels/test_kv_fp8_triton.py"}

new_kernel_tests() {
    if ! "$PY" -c "import pytest" 2>/dev/null; then
        echo "pytest not installed: new-kernels not run (new-kernels-bench still checks them)"
        return 3
    fi
    # One pytest a file, side by side: each compiles its cases for the GPU in
    # children of its own before its first result, and the box has the cores.
    local file name rc=0 pids=()
    for file in $NEW_KERNEL_TESTS; do
        name=$(basename "$file" .py)
        PAGEDSERVE_TEST_DEVICE=cuda PYTHONPATH="tests:$PYTHONPATH" timeout -k 10 "${NEW_KERNELS_TIMEOUT:-240}" \
            "$PY" -m pytest "$file" -q -rf --confcutdir=tests/kernels -p no:cacheprovider \
            --junitxml="$OUT/new-kernels-$name.xml" >"$OUT/new-kernels-$name.log" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid" || rc=1
    done
    for file in $NEW_KERNEL_TESTS; do
        name=$(basename "$file" .py)
        echo "$name: $(tail -n 1 "$OUT/new-kernels-$name.log")"
    done
    return $rc
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
step gemv-bench "$PY" -m bench.gpu.gpu_gemv --output "$OUT/gemv.json"
step graphs-speed "$PY" -m bench.gpu.gpu_graphs --parts speed --output "$OUT/graphs-speed.json"
step graphs-parity "$PY" -m bench.gpu.gpu_graphs --parts parity --output "$OUT/graphs-parity.json"
step new-kernels new_kernel_tests
step new-kernels-bench timeout -k 10 "${NEW_KERNELS_BENCH_TIMEOUT:-180}" \
    "$PY" -m bench.gpu.gpu_kernels --output "$OUT/new-kernels.json"
step kernel-tests kernel_tests
step kernel-bench "$PY" -m bench.kernels.kernels --output "$OUT/kernels.json"
step e2e e2e
step graphs-tests graphs_tests

echo "summary: $SUMMARY"
exit $FAILED
