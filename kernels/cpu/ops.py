"""Building and loading the compiled CPU ops (``kernels/cpu/csrc/``): paged
attention, and linear layers over bf16 weights.

One source, four builds, chosen by the running CPU at load time::

    isa          compiler flags                             pair length
    avx512bf16   -mavx512f/bw/vl/dq -mavx512bf16 -mavx512vnni       32
                 -mfma -mf16c
    avx512       -mavx512f/bw/vl/dq -mavx512vnni -mfma -mf16c       32
    avx2         -mavx2 -mfma -mf16c                                16
    portable     none (the compiler's baseline)                     16

The avx512 build is the AVX-512 one for CPUs with VNNI but no BF16 (Cascade
Lake, Ice Lake, and hypervisors that hide AVX512-BF16 from their guests):
512-bit vectors and the int8 dot product, with bf16 weights widened to fp32
for FMAs where the avx512bf16 build multiplies them as they are.

The avx512bf16 build also carries AMX tile code (``csrc/amx.h``; ``amx_rows.h``
for GGUF decode batches), taken at run time where the CPU has AMX-TILE and
AMX-BF16 and Linux grants the process its tile state (``PAGEDSERVE_CPU_AMX=off`` keeps the AVX-512 tiles):
the compiler never emits AMX instructions on its own, so the build still runs
on AVX512-BF16 CPUs without AMX.

Each build is its own extension *and* op namespace
(``torch.ops.pagedserve_cpu_<isa>``), compiled by
``torch.utils.cpp_extension.load`` at first use into::

    $XDG_CACHE_HOME/pagedserve/cpu_kernels/py311-torch2.13.0+cpu/pagedserve_cpu_avx2/

so builds for different ISAs, Pythons or torch versions never overwrite each
other.  Processes building at once queue on an ``flock`` beside the build
(the kernel drops it when its holder dies), not on torch's own lock file
alone: a build killed half-way leaves torch's file behind, and every later
build would wait on it for ever.
Nothing is compiled at import; ``python -m kernels.cpu.ops`` compiles ahead
of time (``make install`` runs it), else the first call of an op does
(about half a minute on two cores, then 0.01 s to load from the cache).

``PAGEDSERVE_CPU_KERNELS`` = auto (default) | avx512bf16 | avx512 | avx2 | portable | off
forces a build, or the pure-PyTorch path.  When the build fails (no compiler,
no ninja) the PyTorch path serves, after one warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import platform
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "PAGEDSERVE_CPU_KERNELS"
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
# -ffp-contract=off: the compiler must not fuse a * b + c on its own, so the
# fold of two softmax states rounds the same way wherever it is inlined.
# -fno-gnu-unique: a function-local static of an inline function (linear.h's
# pair order, worked out once per build) is otherwise a GNU_UNIQUE symbol,
# which the dynamic linker makes one object across every library loaded:
# with two builds in one process (the tests load all three) the AVX2 build
# read the AVX-512 build's pair order and multiplied garbage.
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fno-gnu-unique", "-fopenmp"]
ISA_FLAGS = {
    # VNNI: the quantized linear's int8 dot product (every AVX512-BF16 CPU has it).
    "avx512bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni",
                   "-mavx2", "-mfma", "-mf16c", "-DPAGEDSERVE_ISA_AVX512BF16"],
    # No BF16: VNNI is the floor (the int8 strips and rows need it).
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
               "-mavx2", "-mfma", "-mf16c", "-DPAGEDSERVE_ISA_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DPAGEDSERVE_ISA_AVX2"],
    "portable": [],
}
# Elements per vector pair (two fp32 vectors): a head_dim, or a linear layer's
# in_features, must be a multiple of it for a build to take it.
PAIR_LENGTH = {"avx512bf16": 32, "avx512": 32, "avx2": 16, "portable": 16}
ISAS = tuple(ISA_FLAGS)


def extension_name(isa: str) -> str:
    """Extension file and op namespace of one build."""
    return f"pagedserve_cpu_{isa}"


def cache_root() -> Path:
    """Where builds live: under the project's cache dir, keyed by Python and torch."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    return Path(base) / "pagedserve" / "cpu_kernels" / tag


def cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _torch_probe(name: str) -> bool:
    """torch's cpuinfo probes (they also check that the OS saves the registers)."""
    return bool(getattr(torch.cpu, name, lambda: False)())


# Cached: the answer cannot change within a process, and reading /proc/cpuinfo
# on every attention call cost ~100 us (30 layers: 3 ms of a decode step).
@functools.lru_cache(maxsize=1)
def isa_for_this_cpu() -> str:
    """The best build this CPU runs: avx512bf16, avx512, avx2 or portable."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "portable"
    flags = cpuinfo_flags()  # empty where /proc is missing: trust torch's probes
    avx512 = not flags or {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c"} <= flags
    if _torch_probe("_is_avx512_bf16_supported") and avx512:
        return "avx512bf16"
    if _torch_probe("_is_avx512_supported") and _torch_probe("_is_vnni_supported") and avx512:
        return "avx512"
    if _torch_probe("_is_avx2_supported") and (not flags or {"fma", "f16c"} <= flags):
        return "avx2"
    return "portable"


def runnable_isas() -> tuple[str, ...]:
    """This CPU's best build and every build below it (ISAS is best first): the
    builds the kernel tests compare against the reference here."""
    return ISAS[ISAS.index(isa_for_this_cpu()):]


def requested_isa() -> str | None:
    """The build to use: PAGEDSERVE_CPU_KERNELS, else this CPU's best; None = off.
    Read on every call (the tests switch builds within a process), its meaning cached."""
    return _isa_of(os.environ.get(ENV_VAR, "auto"))


@functools.lru_cache(maxsize=None)
def _isa_of(value: str) -> str | None:
    """What a PAGEDSERVE_CPU_KERNELS value asks for."""
    choice = value.strip().lower() or "auto"
    if choice == "off":
        return None
    if choice == "auto":
        return isa_for_this_cpu()
    if choice not in ISA_FLAGS:
        raise ValueError(f"{ENV_VAR}={choice!r}: expected auto, off or one of {ISAS}")
    return choice


def build(isa: str, verbose: bool = False):
    """Compile (or find cached) and load one build; return its op namespace. Raises on failure."""
    from torch.utils import cpp_extension

    name = extension_name(isa)
    directory = cache_root() / name
    directory.mkdir(parents=True, exist_ok=True)
    flags = COMMON_FLAGS + ISA_FLAGS[isa]
    with build_lock(directory):
        cpp_extension.load(
            name=name,
            sources=[str(SOURCE_DIR / "ops.cpp")],
            extra_cflags=flags + [f"-DPAGEDSERVE_OPS_NS={name}"],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(SOURCE_DIR)],
            build_directory=str(directory),
            is_python_module=False,
            verbose=verbose,
        )
    return getattr(torch.ops, name)


@contextlib.contextmanager
def build_lock(directory: Path):
    """Hold the build directory's flock; clear a dead builder's torch lock file.

    Every build goes through here, so once we hold the flock no live process
    is inside torch's build: a ``lock`` file still there was left by one that
    was killed (torch's baton would wait on it with no end)."""
    with open(directory / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# Cached per process: torch.ops registrations are process-wide anyway, and a
# failed build is tried (and reported) once, not on every call.
@functools.lru_cache(maxsize=None)
def load(isa: str):
    """The op namespace of one build, or None (logged once) when it cannot be built."""
    try:
        return build(isa)
    except Exception as exc:  # no compiler, no ninja, a compiler error: fall back
        logger.warning(
            "compiled CPU ops (%s) unavailable, using the PyTorch paths: %s "
            "(needs a C++ compiler and ninja; %s=off silences this)", isa, _reason(exc), ENV_VAR)
        return None


def _reason(exc: Exception) -> str:
    """One line out of a build failure (ninja output can run to pages)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    text = (errors or lines or [type(exc).__name__])[0]
    return text[:300]


def current_ops():
    """The compiled ops for this process (PAGEDSERVE_CPU_KERNELS, else this
    CPU's best build), or None: turned off, or a failed build (logged once)."""
    return _ops_of(os.environ.get(ENV_VAR, "auto"))


# Several calls a decode step (the final norm, the head, the argmax): what a
# value of the variable loads is looked up once, not worked out again (~4 us).
@functools.lru_cache(maxsize=None)
def _ops_of(value: str):
    isa = _isa_of(value)
    return None if isa is None else load(isa)


def ops_for(width: int):
    """The compiled ops for this process (PAGEDSERVE_CPU_KERNELS, else this
    CPU's best build) if they take rows of `width` elements (a head_dim, a
    linear layer's in_features), else None: turned off, a width the build's
    vectors don't divide, or a failed build (logged once)."""
    isa = requested_isa()
    if isa is None or width % PAIR_LENGTH[isa]:
        return None
    return load(isa)


def unavailable_reason(width: int, what: str = "head_dim") -> str:
    """Why ops_for(width) is None, in a sentence; `what` names the width."""
    isa = requested_isa()
    if isa is None:
        return f"turned off ({ENV_VAR}=off)"
    if width % PAIR_LENGTH[isa]:
        return f"the {isa} build needs {what} a multiple of {PAIR_LENGTH[isa]}, got {width}"
    return f"the {isa} build failed (see the warning above; needs a C++ compiler and ninja)"


def main(argv: list[str] | None = None) -> int:
    """Compile ahead of time: ``python -m kernels.cpu.ops [--isa NAME | --runnable] [--verbose]``."""
    import argparse
    import time

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--isa", choices=ISAS, default=None, help="default: this CPU's best")
    parser.add_argument("--runnable", action="store_true",
                        help="every build this CPU runs, side by side (what the tests load)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.runnable:
        return build_side_by_side(runnable_isas(), args.verbose)
    isa = args.isa or isa_for_this_cpu()
    start = time.perf_counter()
    ops = build(isa, verbose=args.verbose)
    print(f"compiled CPU ops: {isa} ({ops.isa()}) in {time.perf_counter() - start:.1f} s, "
          f"cached under {cache_root()}")
    return 0


def build_side_by_side(isas, verbose: bool) -> int:
    """Each build in its own process, all at once: one translation unit each, so
    one compiler per build is what uses the cores (a cached build loads at once)."""
    import subprocess

    command = [sys.executable, "-W", "ignore::RuntimeWarning", "-m", "kernels.cpu.ops"] + (["--verbose"] if verbose else [])
    children = [subprocess.Popen(command + ["--isa", isa]) for isa in isas]
    failed = [isa for isa, child in zip(isas, children) if child.wait() != 0]
    if failed:
        print(f"compiled CPU ops: the {', '.join(failed)} build(s) failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
