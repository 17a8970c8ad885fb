"""Which lane of `make test` (scripts/test_lanes.sh) runs each module that
does not run in the parallel lane; tests/conftest.py marks their tests, and
the script passes each lane its files, so that a lane's pytest collects only
what it runs (a whole-suite collection costs ~25 CPU-seconds on a small core).

    python tests/lanes.py serial|background|own_process   prints a lane's files

No imports: the script reads it before any pytest starts.
"""

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
BACKGROUND = frozenset({
    "tests/engine/test_spec_decode_parity.py",
    "tests/engine/test_hf_parity.py",
    "tests/engine/test_fused_layer.py",
    "tests/engine/test_structured_outputs.py",
    "tests/engine/test_model_families.py",
    "tests/engine/test_prefix_caching_parity.py",
    "tests/engine/test_sliding_window_blocks.py",
    "tests/engine/test_pooling.py",
})

LANES = {"serial": SERIAL, "background": BACKGROUND, "own_process": OWN_PROCESS}

if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2 or sys.argv[1] not in LANES:
        sys.exit(f"usage: python tests/lanes.py {'|'.join(LANES)}")
    print(" ".join(sorted(LANES[sys.argv[1]])))
