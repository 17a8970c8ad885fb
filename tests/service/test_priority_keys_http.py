"""`priority` on a server shared by keys (issue #57, finding 5): a value outside
a signed 32-bit integer is a 400 naming it, for every key; a key that is not an
admin key cannot ask for a priority more urgent than --min-priority-non-admin
(403 naming it, refused rather than clamped); an admin key takes any value in
range; /v1/responses takes `priority` as chat does and the engine schedules by it;
the pooling routes, which check it on their own path, answer the same.

One server for the module: --scheduling-policy priority, one seat
(max_num_seqs 1, so a request that ranks behind the running one waits, where
/metrics shows its priority), a tenant key and an admin key, the floor at -5
(not the default 0, so a floor hard-wired to 0 would show).
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from live_server import run_server, tiny_config, wait_until
from service.protocol.requests import PRIORITY_MAX, PRIORITY_MIN

pytestmark = pytest.mark.usefixtures("single_thread")

TENANT, ADMIN, FLOOR = "tenant-key", "admin-key", -5
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
# (path, body) of every route that takes `priority` on a generating server.
ROUTES = [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 1}),
    ("/v1/chat/completions", CHAT),
    ("/v1/responses", {"input": "hello", "max_output_tokens": 1}),
    ("/v1/chat/completions/render", CHAT),
    ("/v1/completions/render", {"prompt": "hello", "max_tokens": 1}),
]
IDS = [path for path, _ in ROUTES]


@pytest.fixture(scope="module")
def live(tiny_llama_path):
    config = tiny_config(tiny_llama_path, engine={"scheduling_policy": "priority",
                                                  "max_num_seqs": 1, "max_model_len": 1024},
                         api_keys=(TENANT,), admin_keys=(ADMIN,),
                         min_priority_non_admin=FLOOR)
    with run_server(config) as server:
        # The first step may wait for the compiled ops to build: not inside a test.
        assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, TENANT,
                    0, timeout=600).status_code == 200
        yield server


def post(live, path: str, body: dict, key: str, priority: int,
         timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json={**body, "priority": priority},
                      headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def refused(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == "priority", error
    return error


@pytest.mark.parametrize("path, body", ROUTES, ids=IDS)
def test_a_priority_outside_32_bits_is_refused_for_every_key(live, path, body):
    for key in (ADMIN, TENANT):
        for value in (PRIORITY_MAX + 1, 2**63, 10**30):
            refused(post(live, path, body, key, value), 400)
    refused(post(live, path, body, ADMIN, PRIORITY_MIN - 1), 400)
    refused(post(live, path, body, ADMIN, -(2**63)), 400)
    # The edges themselves are in range.
    assert post(live, path, body, TENANT, PRIORITY_MAX).status_code == 200
    assert post(live, path, body, ADMIN, PRIORITY_MIN).status_code == 200


@pytest.mark.parametrize("path, body", ROUTES, ids=IDS)
def test_a_tenant_key_cannot_jump_the_queue(live, path, body):
    """Below the floor: 403 naming `priority` and the flag; at it and above: served."""
    for value in (FLOOR - 1, -(10**9), PRIORITY_MIN):
        error = refused(post(live, path, body, TENANT, value), 403)
        assert error["code"] == "priority_not_allowed"
        assert "--min-priority-non-admin" in error["message"]
    for value in (FLOOR, 10):
        assert post(live, path, body, TENANT, value).status_code == 200


@pytest.mark.parametrize("path, body", ROUTES, ids=IDS)
def test_an_admin_key_takes_any_priority_in_range(live, path, body):
    assert post(live, path, body, ADMIN, FLOOR - 1).status_code == 200


def test_the_floor_needs_a_key_to_be_read(live):
    """Without a key the guard answers 401 before any priority is looked at."""
    response = httpx.post(f"{live.url}/v1/completions",
                          json={"prompt": "x", "max_tokens": 1, "priority": -100}, timeout=30)
    assert response.status_code == 401


BY_PRIORITY = re.compile(r"^pagedserve:num_requests_by_priority\{([^}]*)\} (\S+)$", re.M)


def waiting_priorities(live) -> dict[str, float]:
    """/metrics' waiting requests by priority label."""
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    found = {}
    for labels, value in BY_PRIORITY.findall(text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if labels["state"] == "waiting":
            found[labels["priority"]] = float(value)
    return found


def test_the_responses_priority_reaches_the_engine(live, monkeypatch):
    """One seat, held by a long streamed priority-0 completion: a /v1/responses
    request at priority 7 ranks behind it and waits, counted under priority 7
    (had the priority been dropped, its 0 would tie and wait under "0"; a more
    urgent value would preempt the holder). The holder's client then leaves, and
    the responses request runs. Each step is slowed (a big model's pace), so the
    holder outlasts the look however fast the machine."""
    runner = live.engine.runner
    execute = runner.execute

    def slow_execute(*args, **kwargs):
        time.sleep(0.05)
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", slow_execute)
    holder = {"prompt": [5, 6, 7, 8], "max_tokens": 1000, "ignore_eos": True, "stream": True,
              "priority": 0}
    answers: list[httpx.Response] = []
    headers = {"Authorization": f"Bearer {TENANT}"}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{live.url}/v1/completions", json=holder,
                           headers=headers) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # its first token: it holds the seat
            waiting = threading.Thread(target=lambda: answers.append(post(
                live, "/v1/responses", {"input": "hi", "max_output_tokens": 2}, TENANT, 7)))
            waiting.start()
            seen = wait_until(lambda: waiting_priorities(live).get("7") == 1, timeout=60)
            assert seen, waiting_priorities(live)
        waiting.join(120)  # the holder's client left: its request is aborted
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] in ("completed", "incomplete")


def test_the_pooling_routes_take_the_same_limits(tmp_path):
    """The pooling routes check priority on their own path (service/serving/pooling.py):
    the same range, floor and admin key, on a tiny BERT embedder's server."""
    from engine.config import EngineConfig
    from pooling_models import make_bert_embedder
    from service.config import ServiceConfig

    engine = EngineConfig(model=str(make_bert_embedder(tmp_path / "bert")), runner="pooling",
                          dtype="float32", seed=0, max_model_len=128,
                          kv_cache_memory_bytes=16 << 20, scheduling_policy="priority")
    config = ServiceConfig(engine=engine, served_model_name="pool", api_keys=(TENANT,),
                           admin_keys=(ADMIN,), min_priority_non_admin=FLOOR)
    with run_server(config) as server:
        # The first step may wait for the compiled ops to build.
        assert post(server, "/v1/embeddings", {"input": "x"}, TENANT, 0,
                    timeout=600).status_code == 200
        for path, body in (("/v1/embeddings", {"input": "hello"}), ("/pooling", {"input": "hi"}),
                           ("/score", {"text_1": "a", "text_2": ["b"]})):
            refused(post(server, path, body, ADMIN, PRIORITY_MAX + 1), 400)
            error = refused(post(server, path, body, TENANT, FLOOR - 1), 403)
            assert error["code"] == "priority_not_allowed"
            for key, value in ((TENANT, FLOOR), (ADMIN, FLOOR - 1)):
                answer = post(server, path, body, key, value)
                assert answer.status_code == 200, (path, key, answer.text)
