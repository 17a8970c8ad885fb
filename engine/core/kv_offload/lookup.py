"""Remote look-ups in the background: no step waits on the network.

Asking Redis whether it holds a prompt's blocks is a round trip, and up to its
0.5 s reply timeout when the server is sick, so a step never asks it. As
vLLM's KV connectors do (LMCache's `get_num_new_matched_tokens` answers "not
known yet" while its look-up runs, and the scheduler asks again at a later
step), the first time a sequence comes up for admission its look-up starts on
the look-up thread and the sequence waits aside in the scheduler's `loading`
list, holding up nobody. At a later step the answer decides what to load:

    step k     head of the queue: device hits h0-h2, h3 missing: look-up starts -> aside
    step k+1   answered: Redis holds h0-h7; a load job starts for h3-h7          -> aside
    step k+n   loaded: back at the head, admitted with h0-h7 as hits

A look-up asks about the sequence's whole chain, not only past its device hits
(as LMCache looks up the whole prompt): a sequence waiting aside holds no
blocks, so its device hits may be evicted before the answer is used.

A look-up not answered within LOOKUP_WAIT_SECONDS is given up: the sequence is
admitted with what the device and the local tiers hold, and the rest is
computed (a waiting request costs more than the recomputation a slow cache
would save). The answer may be stale by the time it is used; a block gone
meanwhile is a failed load, which is computed too. Never wrong KV.

The local tiers (host memory, disk) answer from in-memory indexes, so the
offload manager asks them on the engine thread, at admission.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from engine.core.kv_offload.tier import Tier

logger = logging.getLogger(__name__)

# The longest a sequence waits aside for the remote tiers' answer. A healthy
# Redis answers in about a millisecond.
LOOKUP_WAIT_SECONDS = 0.2


@dataclass(eq=False)
class Lookup:
    future: Future  # -> the block hashes that some remote tier holds
    deadline: float  # monotonic time after which the sequence goes on without the answer

    def waiting(self) -> bool:
        """Not answered yet, and not given up on either."""
        return not self.future.done() and time.monotonic() < self.deadline


class RemoteLookups:
    """One look-up per sequence waiting for admission, run on a thread of its own
    (not the load thread: a look-up must not queue behind megabytes of loads)."""

    def __init__(self, tiers: list[Tier]) -> None:
        self.tiers = tiers
        self.lookups: dict[int, Lookup] = {}  # sequence -> its look-up
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kv-lookup")

    def answer(self, seq_id: int, chain: list[bytes]) -> set[bytes] | None:
        """Which blocks of the sequence's `chain` the remote tiers hold, as far as is
        known now (engine thread); None while the sequence should wait for the
        answer, its look-up started here the first time."""
        if not self.tiers or not chain:
            return set()
        lookup = self.lookups.get(seq_id)
        if lookup is None:
            future = self.pool.submit(self._ask, chain)
            self.lookups[seq_id] = Lookup(future, time.monotonic() + LOOKUP_WAIT_SECONDS)
            return None
        if lookup.waiting():
            return None
        if not lookup.future.done():
            return set()  # given up: go on without it
        if lookup.future.exception() is not None:  # a tier must never take the engine down
            logger.error("looking up KV blocks in the remote tiers failed: %r",
                         lookup.future.exception())
            return set()
        return lookup.future.result()

    def _ask(self, hashes: list[bytes]) -> set[bytes]:
        """Look-up thread: which of `hashes` the remote tiers hold (a round trip each)."""
        held = set()
        for tier in self.tiers:
            held.update(h for h, present in zip(hashes, tier.present(hashes)) if present)
        return held

    def waiting(self, seq_id: int) -> bool:
        """The sequence waits for its look-up's answer."""
        lookup = self.lookups.get(seq_id)
        return lookup is not None and lookup.waiting()

    def forget(self, seq_id: int) -> None:
        """Admitted or ended: an answer still to come is dropped; a later admission
        (after a preemption) looks up afresh."""
        self.lookups.pop(seq_id, None)

    def unanswered(self) -> list[Future]:
        return [lookup.future for lookup in self.lookups.values() if not lookup.future.done()]

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)  # nobody waits for an answer now
