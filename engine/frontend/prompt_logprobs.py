"""A request's prompt logprobs across its prefill, and prompts that end the request.

The runner scores each prefill chunk's prompt tokens (engine/model/prompt_logprobs.py);
`settle_prompts` adds every chunk to its request's `PromptLogprobsState`, which keeps
them by position:

    entries   [None, {t1: ..}, {t2: ..}, ...]    entry i scores prompt token i
    chunk     start = p: rows score tokens p + 1, p + 2, ...

A position already held is skipped, so a sequence preempted and recomputed from
0, or a second sample computing the same prompt, adds nothing twice. Such a
request takes no prefix-cache hits (engine/core/scheduler.py), so its chunks
always start where the last one stopped: nothing comes from a cache that holds
K/V but no logits.

`max_tokens=0` (the service allows it with completions' `echo`): the request
ends with its prompt. The step that computes the prompt's last chunk samples
nothing for it (`prompt_ends`), and once the chunk is in, the sequence finishes
with "length" and an empty output (`settle_prompts`), as max_tokens says.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.core.sched_output import SchedulerOutput
from engine.core.sequence import Sequence, SequenceStatus
from engine.model.prompt_logprobs import PromptChunk
from engine.outputs import Logprob, PromptLogprobs, RequestOutputKind


class PromptLogprobsState:
    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.entries: PromptLogprobs = [None]  # nothing scores the first token
        self.delivered = False

    @property
    def complete(self) -> bool:
        return len(self.entries) >= len(self.prompt_token_ids)

    def add(self, chunk: PromptChunk) -> None:
        """The chunk's rows for positions not held yet, in order."""
        first = len(self.entries) - 1 - chunk.start  # rows before it are held already
        if first < 0:
            return  # a gap (never without prefix hits): no entry lands in the wrong place
        for i in range(first, len(chunk.token_logprobs)):
            token = self.prompt_token_ids[chunk.start + 1 + i]
            entry = {token: Logprob(chunk.token_logprobs[i], chunk.ranks[i])}
            for rank, (top_id, logprob) in enumerate(
                    zip(chunk.top_ids[i], chunk.top_logprobs[i]), start=1):
                entry.setdefault(top_id, Logprob(logprob, rank))
            self.entries.append(entry)

    def take(self, kind: RequestOutputKind, finished: bool) -> PromptLogprobs | None:
        """What an output of this kind carries now: all of them once the prefill is
        done (a DELTA output only the first time), else None."""
        if not (self.complete or finished) or (kind is RequestOutputKind.DELTA
                                                and self.delivered):
            return None
        self.delivered = True
        return self.entries


def prompt_ends(scheduled: SchedulerOutput) -> set[int]:
    """Before the step runs: the sequences of max_tokens=0 whose prompt it completes
    sample nothing."""
    ends = set()
    for s in scheduled.sequences:
        if s.sampling is not None and s.sampling.max_tokens == 0:
            s.sampling = None
            ends.add(s.seq_id)
    return ends


def settle_prompts(requests: dict, chunks: dict[int, PromptChunk], ends: set[int],
                   finish: Callable[[Sequence, str], None]) -> dict:
    """After Scheduler.update: add the step's prompt-logprob chunks to their
    requests, and end the `ends` with "length" (`finish`, the engine's). Returns
    the requests that ended, which moved, by id.

    A chunk of a sequence preempted within the step (waiting again) is dropped:
    its blocks were given away before the forward pass read them.
    """
    if not chunks and not ends:
        return {}
    moved = {}
    for request in requests.values():
        for seq in request.seqs:
            chunk = chunks.get(seq.seq_id)
            if chunk is not None and seq.status is not SequenceStatus.WAITING:
                request.prompt_logprobs.add(chunk)
            if (seq.seq_id in ends and seq.status is SequenceStatus.RUNNING
                    and seq.num_computed_tokens >= seq.num_tokens):
                finish(seq, "length")
                moved[request.request_id] = request
    return moved
