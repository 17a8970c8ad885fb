"""service/serving/fair_queue.py: the compile lane's queue takes jobs in turn by
tenant, at most `per_tenant` of a tenant's running at once (issue 57)."""

from __future__ import annotations

import threading

import pytest

from service.serving.fair_queue import FairQueue


def drain(queue: FairQueue, count: int) -> list[tuple[str, str]]:
    """Take `count` jobs, each marked done at once: the order they are handed out."""
    taken = []
    for _ in range(count):
        tenant, job = queue.take()
        taken.append((tenant, job))
        queue.done(tenant)
    return taken


def test_tenants_take_turns_and_each_keeps_its_own_order():
    queue: FairQueue[str] = FairQueue(per_tenant=1)
    for job in ("a1", "a2", "a3"):
        queue.put("A", job)
    queue.put("B", "b1")
    queue.put("C", "c1")
    queue.put("B", "b2")
    assert [job for _, job in drain(queue, 6)] == ["a1", "b1", "c1", "a2", "b2", "a3"]


def test_a_tenant_at_its_cap_is_passed_over_until_its_job_is_done():
    queue: FairQueue[str] = FairQueue(per_tenant=1)
    for job in ("a1", "a2"):
        queue.put("A", job)
    assert queue.take() == ("A", "a1")
    queue.put("B", "b1")
    assert queue.take() == ("B", "b1")  # A's next waits for a1, B need not
    assert queue.running("A") == 1 and queue.waiting("A") == 1
    later: list = []
    taker = threading.Thread(target=lambda: later.append(queue.take()))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive(), "a2 was handed out while a1 still ran"
    queue.done("A")
    taker.join(5)
    assert later == [("A", "a2")]


def test_without_a_cap_one_tenant_is_first_come_first_served():
    queue: FairQueue[int] = FairQueue()
    for job in range(5):
        queue.put("", job)
    assert [queue.take()[1] for _ in range(5)] == [0, 1, 2, 3, 4]
    assert queue.running("") == 5


def test_a_discarded_job_is_never_handed_out():
    queue: FairQueue[str] = FairQueue(per_tenant=1)
    for job in ("a1", "a2", "a3"):
        queue.put("A", job)
    assert queue.discard("A", "a2") and not queue.discard("A", "a2")
    assert not queue.discard("B", "a1")
    assert [job for _, job in drain(queue, 2)] == ["a1", "a3"]
    assert queue.waiting("A") == 0 and queue.running("A") == 0


def test_stop_lets_the_jobs_waiting_start_first():
    queue: FairQueue[str] = FairQueue(per_tenant=1)
    queue.put("A", "a1")
    queue.stop(1)
    assert queue.take() == ("A", "a1")
    assert queue.take() is None


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        FairQueue(per_tenant=0)
