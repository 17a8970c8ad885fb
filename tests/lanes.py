"""Which lane of `make test` (scripts/test_lanes.sh) runs each module that
does not run in the parallel lane; tests/conftest.py marks their tests, and
the script passes each lane its files, so that a lane's pytest collects only
what it runs (a whole-suite collection costs ~25 CPU-seconds on a small core).

    python tests/lanes.py serial|background|own_process|parallel   prints a lane's files

The two xdist lanes get their files longest first: xdist hands a free worker
the next module in the order given (--no-loadscope-reorder; its default
order is by test count, which puts one-test modules of a minute last), and a
long module started last runs alone while the other worker has nothing left
(longest-processing-time-first scheduling). Seconds are ci50's (a fresh
clone on a 2-core AVX2 machine); a stale figure only costs some balance.

Only the standard library: the script reads it before any pytest starts.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SERIAL = frozenset({
    "tests/deploy/test_load_balancer.py",  # nginx spreads a burst: arrival times
    "tests/deploy/test_router_front.py",  # another client's refusal within 0.15 s
    "tests/engine/test_kv_offload_redis.py",  # a dead Redis answers within 0.1 s
    "tests/engine/test_kv_offload_threads.py",  # a lookup returns within 50 ms
    "tests/engine/test_tensor_parallel.py",  # three ranks on two cores, a killed rank seen in 10 s
    "tests/service/fleet/test_fleet.py",  # Redis dies and returns under load
    "tests/service/fleet/test_fleet_replicas.py",  # two real SmolLM2 replicas warm up
    "tests/service/guards/test_pacing.py",  # refusals paced to 0.15 s
    "tests/service/guards/test_connection_limits.py",  # header deadlines
    "tests/service/serving/test_concurrency.py",  # one slow request beside fast ones
    "tests/service/serving/test_prep_lanes.py",  # a slow compile beside a plain chat
    "tests/service/serving/test_streaming.py",  # a token within 0.3 s of the first
    "tests/service/test_faults.py",  # failures answered within seconds
    "tests/service/test_hardening.py",  # latency under load vs idle
    "tests/service/test_shutdown.py",  # drain and exit times
    "tests/service/test_tensor_parallel_serve.py",  # ranks as processes, a kill seen in 10 s
    "tests/service/test_constraint_limits_http.py",  # a hostile schema answered within 5 s
})

# Not timing, but not for xdist: schemathesis gives its 13 fuzzed operations
# one node id, and xdist, which schedules by node id, would run only the first
# of them. Each runs in a pytest of its own beside the parallel lane.
OWN_PROCESS = frozenset({
    "tests/service/test_schema_fuzz.py",
})

# In-process compute with no wall-clock deadline, no subprocess timeout and no
# rank processes: safe to starve for seconds at a time, so they soak up the
# cycles the serial phase leaves idle (~540 of its 1,260 core-seconds).
BACKGROUND = (
    "tests/engine/test_spec_decode_parity.py",  # 190 s
    "tests/engine/test_model_families.py",  # 164
    "tests/engine/test_structured_outputs.py",  # 161
    "tests/engine/test_hf_parity.py",  # 136
    "tests/engine/test_fused_layer.py",  # 125
    "tests/engine/test_prefix_caching_parity.py",  # 67
    "tests/engine/test_pooling.py",  # 32
    "tests/engine/test_sliding_window_blocks.py",  # 12
)

# The parallel lane's modules of 20 s and more, longest first; every other
# module follows in path order.
PARALLEL_FIRST = (
    "tests/kernels/test_kernels_triton.py",  # 112 s
    "tests/bench/fleet/test_routing_smoke.py",  # 73
    "tests/service/test_openai_api.py",  # 66
    "tests/service/tool_calls/test_tool_calls_http.py",  # 62
    "tests/engine/test_gguf_file.py",  # 57
    "tests/engine/test_lora.py",  # 51
    "tests/engine/test_gguf_serving.py",  # 46
    "tests/kernels/test_kv_int8_triton.py",  # 43
    "tests/kernels/test_kv_fp8_triton.py",  # 42
    "tests/kernels/test_noncausal_prefill.py",  # 42
    "tests/engine/test_tensor_parallel_families.py",  # 34
    "tests/bench/gpu/test_bench_gpu_kernels.py",  # 34
    "tests/service/responses/test_responses_http.py",  # 30
    "tests/clients/test_web.py",  # 28
    "tests/kernels/test_gemv_triton.py",  # 28
    "tests/deploy/test_router_compose.py",  # 27
    "tests/engine/test_triton_backend.py",  # 26
    "tests/service/test_kv_offload_http.py",  # 26
    "tests/service/test_reasoning_http.py",  # 25
    "tests/service/test_errors.py",  # 24
    "tests/engine/test_kv_offload_engine.py",  # 24
    "tests/service/test_pooling_http.py",  # 24
    "tests/kernels/test_quant_linear_triton.py",  # 22
    "tests/engine/test_loader.py",  # 21
    "tests/kernels/test_kernels_cpu_compiled.py",  # 21
)

LANES = {"serial": SERIAL, "background": BACKGROUND, "own_process": OWN_PROCESS}


def parallel() -> list[str]:
    """Every test module no other lane runs: PARALLEL_FIRST, then the rest."""
    taken = set().union(*LANES.values())
    found = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").rglob("test_*.py"))
    rest = [path for path in found if path not in taken and path not in PARALLEL_FIRST]
    return list(PARALLEL_FIRST) + rest


def lane_files(lane: str) -> list[str]:
    if lane == "parallel":
        return parallel()
    return sorted(LANES[lane]) if isinstance(LANES[lane], frozenset) else list(LANES[lane])


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2 or sys.argv[1] not in (*LANES, "parallel"):
        sys.exit(f"usage: python tests/lanes.py {'|'.join(LANES)}|parallel")
    print(" ".join(lane_files(sys.argv[1])))
