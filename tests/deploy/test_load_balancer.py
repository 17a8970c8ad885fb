"""The load balancer for real: Debian's nginx running the configuration that
docker-compose.yml uses, in front of two real replica processes (SmolLM2)
that share a real Redis.

    (a) requests without a session spread over both replicas
    (b) a conversation with X-Session-ID stays on one replica; its second turn
        is a prefix-cache hit
    (c) server-sent events pass through unbuffered
    (e) a replica still warming serves nothing: its share goes to the other
    (d) one replica killed: the next requests succeed on the other

The tests run in this order on one fleet (module scope); each names its
requests with an X-Test-ID header, which the test's access log records with
the replicas nginx tried.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from bench.common.replicas import Replica, system_prompts
from bench.fleet.fleet import seed_fleet
from clients.python import Client
from nginx_server import start_nginx
from redis_server import start_redis

pytestmark = pytest.mark.slow

# B's warm-up must outlast (e) several-fold on any machine: six ~400-token system
# prompts, all within the warm-up budget (the default, a fifth of the pool,
# would take two), against six concurrent two-token chats. No idle re-warming
# (--warm-refresh-seconds): 30 s after start it would prefill the prompts the
# other replica saw in (b) and hold up (c)'s first event by a whole prefill.
FLAGS = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20),
         "--warm-max-blocks", "400", "--warm-refresh-seconds", "3600"]
SYSTEMS = system_prompts(6, 320, seed=7)


@pytest.fixture(scope="module")
def fleet(smollm2_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fleet")
    redis = start_redis(folder)
    flags = FLAGS + ["--redis-url", redis.url]
    replicas = {}
    nginx = None
    try:
        for name in ("A", "B"):
            replicas[name] = Replica.start(flags + ["--replica-id", name], folder, name)
        for replica in replicas.values():
            replica.wait_ready()
        nginx = start_nginx(folder / "nginx", [r.url.removeprefix("http://")
                                               for r in replicas.values()])
        yield SimpleNamespace(redis=redis, replicas=replicas, nginx=nginx, folder=folder,
                              flags=flags)
    finally:
        if nginx is not None:
            nginx.stop()
        for replica in replicas.values():
            replica.stop()
        redis.kill()


def chat(fleet, messages, session: str | None = None, max_tokens: int = 8) -> tuple[str, dict]:
    test_id = uuid.uuid4().hex
    headers = {"X-Test-ID": test_id}
    if session is not None:
        headers["X-Session-ID"] = session
    response = httpx.post(f"{fleet.nginx.url}/v1/chat/completions", headers=headers,
                          timeout=120, json={"messages": messages, "max_tokens": max_tokens,
                                             "temperature": 0})
    assert response.status_code == 200, response.text
    return test_id, response.json()


def served(fleet, test_ids: list[str]) -> list[str]:
    """The replica (A or B) that answered each request, by the access log."""
    by_address = {r.url.removeprefix("http://"): name for name, r in fleet.replicas.items()}
    deadline = time.monotonic() + 10
    while True:
        log = fleet.nginx.served_by()
        if all(t in log for t in test_ids) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return [by_address[log[t][0].split(", ")[-1]] for t in test_ids]


def test_a_requests_without_a_session_spread_over_both(fleet):
    ids = [chat(fleet, [{"role": "user", "content": f"Say {i}."}])[0] for i in range(8)]
    names = served(fleet, ids)
    assert set(names) == {"A", "B"}, names


def test_b_a_conversation_stays_on_its_replica_and_hits_the_cache(fleet):
    for n in range(4):
        session = f"conversation-{n}"
        messages = [{"role": "system", "content": SYSTEMS[n]},
                    {"role": "user", "content": "What does the shop sell?"}]
        first_id, first = chat(fleet, messages, session)
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And what does it cost?"}]
        second_id, second = chat(fleet, messages, session)
        assert len(set(served(fleet, [first_id, second_id]))) == 1
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_c_events_stream_through_unbuffered(fleet):
    arrivals = []
    with Client(fleet.nginx.url) as client:
        start = time.perf_counter()
        stream = client.chat_stream([{"role": "user", "content": "Count from one to fifty."}],
                                    max_tokens=64, ignore_eos=True, temperature=0)
        assert stream.response.headers["content-type"].startswith("text/event-stream")
        for _ in stream:
            arrivals.append(time.perf_counter() - start)
    assert len(arrivals) >= 50 and stream.done
    # Buffered, every event would land at the end at once; streamed, they spread
    # over the generation (64 decode steps: 0.3 s on a Zen 5 core, seconds on
    # slower ones), so most arrive in a millisecond of their own.
    assert arrivals[0] < 0.5 * arrivals[-1], (arrivals[0], arrivals[-1])
    assert len({round(t, 3) for t in arrivals}) > 30


def test_e_a_warming_replica_serves_nothing(fleet):
    seed_fleet(fleet.replicas["A"], SYSTEMS, SimpleNamespace(seed=3))
    old = fleet.replicas["B"]
    port = int(old.url.rsplit(":", 1)[1])
    old.stop()
    fleet.replicas["B"] = Replica.start(fleet.flags + ["--replica-id", "B"], fleet.folder,
                                        "B-again", port=port)
    statuses = []
    while not statuses or statuses[-1] not in ("warming", "ok"):
        try:
            statuses.append(httpx.get(f"{fleet.replicas['B'].url}/health").json()["status"])
        except httpx.HTTPError:
            statuses.append("not listening")
            time.sleep(0.02)
    assert statuses[-1] == "warming", statuses
    with ThreadPoolExecutor(6) as pool:
        ids = list(pool.map(lambda i: chat(fleet, [{"role": "user", "content": f"Hello {i}"}],
                                           session=f"s-{i}", max_tokens=2)[0], range(6)))
    still_warming = httpx.get(f"{fleet.replicas['B'].url}/health").json()["status"]
    assert still_warming == "warming", "the warm-up ended too soon for this test to show"
    assert served(fleet, ids) == ["A"] * 6
    assert fleet.replicas["B"].metric("e2e_request_latency_seconds_count") == 0  # no request served
    fleet.replicas["B"].wait_ready()


def test_d_a_killed_replica_leaves_the_other_serving(fleet):
    fleet.replicas["B"].process.kill()
    fleet.replicas["B"].process.wait(10)
    ids = [chat(fleet, [{"role": "user", "content": f"Still there {i}?"}],
                session=f"after-kill-{i}", max_tokens=2)[0] for i in range(6)]
    ids += [chat(fleet, [{"role": "user", "content": "And without a session?"}],
                 max_tokens=2)[0] for _ in range(2)]
    assert served(fleet, ids) == ["A"] * 8
