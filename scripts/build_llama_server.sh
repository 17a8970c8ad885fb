#!/usr/bin/env bash
# Build llama.cpp's `llama-server` for side-by-side serving benchmarks.
#
#   bash scripts/build_llama_server.sh [OUTDIR]
#
# BENCHMARK-ONLY: pagedserve never imports, links or runs llama.cpp.  This
# script only exists so `pagedserve bench serve` can be pointed at a reference
# server (see docs/llamacpp.md).  Nothing here is a project dependency.
#
# Where the source comes from: there is no internet here except package
# registries, so llama.cpp is taken from the llama-cpp-python sdist on PyPI,
# which vendors a full llama.cpp tree under vendor/llama.cpp.  The version is
# pinned so benchmark numbers are reproducible (override with
# LLAMA_CPP_PYTHON_VERSION=...).
#
# Result: OUTDIR/bin/llama-server, and beside it llama-quantize (K-quant files
# for the GGUF benchmarks), llama-perplexity and llama-bench, all from the same
# tree (statically linked against llama/ggml, so no extra shared libraries).  Default OUTDIR:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/pagedserve/llama.cpp
# If the binary already exists the script prints its path and does nothing.
#
# Environment knobs: LLAMA_CPP_PYTHON_VERSION, JOBS (default 2),
# EXTRA_CMAKE_ARGS (appended to the configure line).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
OUT="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/pagedserve/llama.cpp}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"

log() { echo "[build_llama_server] $*" >&2; }

if [ -x "$OUT/bin/llama-server" ]; then
    echo "$OUT/bin/llama-server"
    exit 0
fi

# -- toolchain -----------------------------------------------------------------------------
# Python/pip: the project venv if there is one (pip download and, if needed, cmake).
if [ -x "$VENV/bin/python" ]; then
    PY="$VENV/bin/python"
else
    PY="$(command -v python3)"
fi

for tool in gcc g++; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        log "error: $tool not found; a C/C++ compiler is required (e.g. apt-get install build-essential)"
        exit 1
    fi
done

# cmake: the system one if it is new enough (llama.cpp needs >= 3.14), else the
# PyPI `cmake` wheel installed into the project venv.
cmake_ok() {
    local v
    v="$("$1" --version 2>/dev/null | head -n1 | grep -oE '[0-9]+\.[0-9]+' | head -n1)" || return 1
    [ -n "$v" ] || return 1
    [ "${v%%.*}" -gt 3 ] || { [ "${v%%.*}" -eq 3 ] && [ "${v#*.}" -ge 14 ]; }
}
CMAKE=""
if command -v cmake >/dev/null 2>&1 && cmake_ok "$(command -v cmake)"; then
    CMAKE="$(command -v cmake)"
elif [ -x "$VENV/bin/cmake" ] && cmake_ok "$VENV/bin/cmake"; then
    CMAKE="$VENV/bin/cmake"
else
    log "no usable cmake; installing the PyPI cmake wheel into $VENV"
    "$PY" -m pip install --quiet cmake
    CMAKE="$(dirname "$PY")/cmake"
fi
GENERATOR=()
if command -v ninja >/dev/null 2>&1; then
    GENERATOR=(-G Ninja)
fi
log "cmake: $CMAKE ($("$CMAKE" --version | head -n1)); compilers: $(gcc -dumpfullversion)"

# -- source --------------------------------------------------------------------------------
WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

log "llama-cpp-python version: $LLAMA_CPP_PYTHON_VERSION (sdist, vendored llama.cpp)"
"$PY" -m pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$WORK/dl"
SDIST="$(find "$WORK/dl" -maxdepth 1 -name '*.tar.gz' | head -n1)"
[ -n "$SDIST" ] || { log "error: sdist not found in $WORK/dl"; exit 1; }
tar -xzf "$SDIST" -C "$WORK"
SRC="$(find "$WORK" -mindepth 3 -maxdepth 3 -path '*/vendor/llama.cpp' -type d | head -n1)"
[ -n "$SRC" ] && [ -f "$SRC/CMakeLists.txt" ] || { log "error: vendor/llama.cpp missing from $SDIST"; exit 1; }
log "llama.cpp source: $SRC"

# True if the vendored tree declares a CMake option (names drift between versions).
has_option() {
    grep -qsE "option\($1[[:space:]]" "$SRC/CMakeLists.txt" "$SRC/ggml/CMakeLists.txt"
}

# -- configure -----------------------------------------------------------------------------
# GGML_NATIVE=OFF: no -march=native; the ISA is spelled out below instead, so the
#   binary does not depend on what the build host's cpuid happens to report and
#   the explicit GGML_AVX* switches take effect (NATIVE=ON ignores them).
# AVX/AVX2/FMA/F16C/AVX512(+VBMI,VNNI,BF16): what this benchmark CPU supports,
#   each AVX-512 extension only where /proc/cpuinfo names it (else: SIGILL at
#   startup, or a build that uses what the CPU does not advertise: a guest
#   whose hypervisor hides AVX512-BF16 has AVX512F and VNNI without it).
# AMX_*=OFF: ggml's AMX path crashes. On a CPU without AMX it must; on a 2-vCPU
#   Xeon with AMX (2026-12-01) this tree's build died too, SIGILL at its first
#   tile instruction (tilezero in tinygemm_kernel_amx, in an OpenMP worker).
# BUILD_SHARED_LIBS=OFF: one self-contained binary, no libllama/libggml to ship.
# Tests/examples off; only the four tools above are built.
has_flag() { [ ! -r /proc/cpuinfo ] || grep -qw "$1" /proc/cpuinfo; }
on_if() { if has_flag "$1"; then echo ON; else echo OFF; fi; }
AVX512=$(on_if avx512f)
[ "$AVX512" = ON ] || log "warning: host CPU has no avx512f; building without AVX512"
VBMI=OFF; VNNI=OFF; BF16=OFF
if [ "$AVX512" = ON ]; then
    VBMI=$(on_if avx512vbmi); VNNI=$(on_if avx512_vnni); BF16=$(on_if avx512_bf16)
fi
ARGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=OFF
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    -DGGML_AVX512="$AVX512" -DGGML_AVX512_VBMI="$VBMI"
    -DGGML_AVX512_VNNI="$VNNI" -DGGML_AVX512_BF16="$BF16"
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
)
# Version-dependent options: pass them only where this tree still declares them.
# LLAMA_CURL (model download by URL) was removed upstream; no network anyway.
has_option LLAMA_CURL && ARGS+=(-DLLAMA_CURL=OFF)
# No HTTPS needed for a localhost benchmark; avoids needing OpenSSL headers.
has_option LLAMA_OPENSSL && ARGS+=(-DLLAMA_OPENSSL=OFF)
# The web UI would be built with npm or downloaded from Hugging Face at build
# time; neither is possible offline and the benchmark only uses the HTTP API.
has_option LLAMA_BUILD_UI && ARGS+=(-DLLAMA_BUILD_UI=OFF)
has_option LLAMA_USE_PREBUILT_UI && ARGS+=(-DLLAMA_USE_PREBUILT_UI=OFF)
# shellcheck disable=SC2206
ARGS+=(${EXTRA_CMAKE_ARGS:-})

for opt in GGML_NATIVE GGML_AVX GGML_AVX2 GGML_AVX512 GGML_AVX512_VBMI GGML_AVX512_VNNI \
           GGML_AVX512_BF16 GGML_AMX_TILE GGML_AMX_INT8 GGML_AMX_BF16 LLAMA_BUILD_SERVER; do
    has_option "$opt" || log "warning: option $opt not declared by this llama.cpp version"
done

log "configure: ${ARGS[*]}"
"$CMAKE" -S "$SRC" -B "$WORK/build" "${GENERATOR[@]}" "${ARGS[@]}"

# -- build ---------------------------------------------------------------------------------
TOOLS=(llama-quantize llama-perplexity llama-bench llama-server)  # the server last: it marks a build done
start=$SECONDS
"$CMAKE" --build "$WORK/build" --config Release --target "${TOOLS[@]}" -j "$JOBS"
log "built ${TOOLS[*]} in $((SECONDS - start)) s"

mkdir -p "$OUT/bin"
for tool in "${TOOLS[@]}"; do
    BIN="$(find "$WORK/build" -type f -name "$tool" -perm -u+x | head -n1)"
    [ -n "$BIN" ] || { log "error: $tool binary not produced"; exit 1; }
    if ldd "$BIN" 2>/dev/null | grep -q "not found"; then
        log "error: unresolved shared libraries:"; ldd "$BIN" >&2; exit 1
    fi
    cp "$BIN" "$OUT/bin/$tool.tmp.$$"
    mv -f "$OUT/bin/$tool.tmp.$$" "$OUT/bin/$tool"   # atomic: no half-written binary
done
{
    echo "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION"
    echo "cmake ${ARGS[*]}"
} > "$OUT/BUILD_INFO"
echo "$OUT/bin/llama-server"
