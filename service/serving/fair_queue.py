"""A queue of jobs taken in turn by tenant, for a lane's threads (service/serving/lanes.py).

One FIFO queue let one client's compiles hold every other client's behind them
(issue 57: another key's one-field schema waited 118 s). Here each tenant has
a queue of its own, the tenants with jobs waiting take turns (round robin: a
tenant just served goes to the back), and at most `per_tenant` jobs of one
tenant run at once. So with `threads` workers and a cap of one, up to
`threads` tenants compile side by side, and a further tenant waits for one
compile at most (each is bounded by the price check,
engine/sampling/compile_price.py), never behind a tenant's whole queue.

A job given up before it starts (its client left) is taken out of its queue
(`discard`); one already running holds its tenant's place until it ends, so
hanging up and sending again never gives a tenant more threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Generic, TypeVar

J = TypeVar("J")


class FairQueue(Generic[J]):
    """Jobs by tenant, handed out round robin, at most `per_tenant` running per
    tenant (None: no cap; with one tenant that is a plain FIFO queue)."""

    def __init__(self, per_tenant: int | None = None) -> None:
        if per_tenant is not None and per_tenant < 1:
            raise ValueError(f"per_tenant={per_tenant} must be at least 1 (or None)")
        self.per_tenant = per_tenant
        self._changed = threading.Condition()
        # Tenants with jobs waiting, the next to be served first.
        self._waiting: OrderedDict[str, deque[J]] = OrderedDict()
        self._running: dict[str, int] = {}
        self._stopping = 0  # workers to stop once nothing is left waiting

    def put(self, tenant: str, job: J) -> None:
        with self._changed:
            self._waiting.setdefault(tenant, deque()).append(job)
            self._changed.notify()

    def discard(self, tenant: str, job: J) -> bool:
        """Take a job out before it starts; whether it was still waiting."""
        with self._changed:
            jobs = self._waiting.get(tenant)
            if jobs is None or not any(waiting is job for waiting in jobs):
                return False
            jobs.remove(job)
            if not jobs:
                del self._waiting[tenant]
            return True

    def take(self) -> tuple[str, J] | None:
        """The next job that may run and its tenant, waiting for one; None once
        `stop` asked this worker to stop and nothing is left waiting."""
        with self._changed:
            while True:
                picked = self._next()
                if picked is not None:
                    return picked
                if self._stopping and not self._waiting:
                    self._stopping -= 1
                    return None
                self._changed.wait()

    def done(self, tenant: str) -> None:
        """A job of `tenant` ended: its place is free for the tenant's next."""
        with self._changed:
            left = self._running[tenant] - 1
            if left:
                self._running[tenant] = left
            else:
                del self._running[tenant]
            self._changed.notify_all()  # a tenant at its cap may go on now

    def stop(self, workers: int) -> None:
        """Let `workers` workers stop once the jobs waiting now have started."""
        with self._changed:
            self._stopping += workers
            self._changed.notify_all()

    def waiting(self, tenant: str) -> int:
        with self._changed:
            return len(self._waiting.get(tenant, ()))

    def running(self, tenant: str) -> int:
        with self._changed:
            return self._running.get(tenant, 0)

    def _next(self) -> tuple[str, J] | None:
        for tenant, jobs in self._waiting.items():
            if self.per_tenant is not None and self._running.get(tenant, 0) >= self.per_tenant:
                continue
            job = jobs.popleft()
            if jobs:
                self._waiting.move_to_end(tenant)  # its turn is over
            else:
                del self._waiting[tenant]
            self._running[tenant] = self._running.get(tenant, 0) + 1
            return tenant, job
        return None
