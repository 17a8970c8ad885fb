"""Two real replicas, one real Redis: separate `pagedserve serve` processes on the
real SmolLM2. B reports ready only after warming what A made popular, and its
first request with A's system prompt is a cache hit. (The timing comparison
is `pagedserve bench fleet`; tests assert no speed.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.common.replicas import Replica, system_prompts
from bench.fleet.fleet import measure_replica, seed_fleet
from redis_server import start_redis

pytestmark = pytest.mark.slow

SERVER_FLAGS = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20)]


@pytest.fixture
def redis_server(tmp_path):
    server = start_redis(tmp_path)
    yield server
    server.kill()


def test_new_replica_is_ready_only_after_warming(smollm2_path, redis_server, tmp_path):
    args = SimpleNamespace(seed=0, first=4, steady=2)
    systems = system_prompts(2, 150, seed=0)
    fleet = ["--redis-url", redis_server.url]
    replicas = []
    try:
        a = Replica.start(SERVER_FLAGS + fleet + ["--replica-id", "A"], tmp_path, "A")
        replicas.append(a)
        a.wait_ready()
        seed_fleet(a, systems, args)
        b = Replica.start(SERVER_FLAGS + fleet + ["--replica-id", "B"], tmp_path, "B")
        replicas.append(b)
        run = measure_replica(b, "warm", systems, args)
        statuses = [status for _, status in run.statuses]
        assert statuses[-1] == "ok" and "warming" in statuses, statuses
        assert set(statuses[:-1]) <= {"not listening", "warming"}, statuses
        assert run.warm_blocks_at_ready > 0  # read before B's first request
        blocks = int(run.warm_blocks_at_ready) // len(systems)
        assert run.first_cached >= blocks * 16 > 0
        assert run.first10_hit_rate == pytest.approx(run.steady_hit_rate, rel=0.1)
        c = Replica.start(SERVER_FLAGS, tmp_path, "C")  # no Redis: a cold replica
        replicas.append(c)
        cold = measure_replica(c, "cold", systems, args)
        assert cold.statuses[-1][1] == "ok" and "warming" not in [s for _, s in cold.statuses]
        assert cold.first_cached == 0 and cold.warm_blocks_at_ready == 0
    finally:
        for replica in replicas:
            replica.stop()
