"""Request: one request inside LLMEngine, and the RequestOutput it reports each step.

The engine keeps, per choice, how many tokens it has reported and whether it
reported the finish, so that each step can say what is new. What an output
carries is the request's `SamplingParams.output_kind` (engine/outputs.py):

    CUMULATIVE  everything so far: the token and logprob lists are copied and
                the text joined every step, O(n) per step and O(n^2) a stream
    DELTA       only this step's slice of each list, and the detokenizer's
                delta as the text: O(new) per step
    FINAL_ONLY  nothing until every choice finished, then each whole, once
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.sequence import Sequence
from engine.frontend.pooling_requests import pooling_output
from engine.frontend.prompt_logprobs import PromptLogprobsState
from engine.outputs import (CompletionOutput, PoolingRequestOutput, RequestOutput,
                            RequestOutputKind)
from engine.sampling.detokenizer import IncrementalDetokenizer
from engine.sampling.stopping import StopChecker


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    stop_checkers: list[StopChecker]  # per seq; each feeds its detokenizer
    reported: list[int] = field(default_factory=list)  # tokens already handed out, per seq
    finish_reported: list[bool] = field(default_factory=list)  # per seq
    # SamplingParams.prompt_logprobs: what the prefill scored so far (None: not asked).
    prompt_logprobs: PromptLogprobsState | None = None
    # A pooling request (engine/frontend/pooling_requests.py): its params, and its
    # answer once the step that computed its prompt handed it back.
    pooling: object | None = None
    pooled: object | None = None

    def __post_init__(self) -> None:
        if self.prompt_logprobs is None and self.seqs[0].params.prompt_logprobs is not None:
            self.prompt_logprobs = PromptLogprobsState(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    @property
    def output_kind(self) -> RequestOutputKind:
        return self.seqs[0].params.output_kind  # every choice shares the params

    def output(self) -> RequestOutput | PoolingRequestOutput | None:
        """This step's report of the request, which moved in it (None: a
        FINAL_ONLY request that has not finished yet)."""
        if self.pooling is not None:
            return pooling_output(self)
        kind = self.output_kind
        if kind is RequestOutputKind.FINAL_ONLY:
            if not self.finished:
                return None  # nothing is built before the end: no per-step copies
            completions = [_whole(seq, detok) for seq, detok in zip(self.seqs, self.detokenizers)]
        else:
            completions = [self._progress(i, kind) for i in range(len(self.seqs))]
            if kind is RequestOutputKind.DELTA:
                # As in vLLM, a delta carries only the choices that moved (n > 1).
                completions = [c for c in completions if c.changed]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            num_cached_tokens=min(seq.num_cached_tokens for seq in self.seqs),
            prompt_logprobs=(None if self.prompt_logprobs is None
                             else self.prompt_logprobs.take(kind, self.finished)),
        )

    def _progress(self, i: int, kind: RequestOutputKind) -> CompletionOutput:
        """Choice i as this step left it: CUMULATIVE copies all of it so far,
        DELTA slices off only what the step added."""
        seq, detok = self.seqs[i], self.detokenizers[i]
        # A stream holds back text that may still turn out to be a stop string.
        hold_back = self.stop_checkers[i].held_back_length()
        start, end = self.reported[i], len(seq.output_token_ids)
        self.reported[i] = end
        # A choice changed if it grew or finished in this step; sibling choices
        # that finished earlier ride along unchanged (CUMULATIVE, n > 1).
        changed = start < end or (seq.is_finished and not self.finish_reported[i])
        self.finish_reported[i] = seq.is_finished
        delta_text = detok.get_delta(seq.is_finished, hold_back)
        delta_token_ids = seq.output_token_ids[start:end]
        if kind is RequestOutputKind.DELTA:
            text, token_ids, first = delta_text, delta_token_ids, start
        else:
            text, token_ids, first = detok.output_text, list(seq.output_token_ids), 0
        return _completion(seq, text, token_ids, first, end, delta_text, delta_token_ids, changed)


def _whole(seq: Sequence, detok: IncrementalDetokenizer) -> CompletionOutput:
    """A finished choice, whole (FINAL_ONLY): the consumer saw none of it
    before, so its delta is all of it. Copied once, at the end."""
    text, token_ids = detok.output_text, list(seq.output_token_ids)
    return _completion(seq, text, token_ids, 0, len(token_ids), text, token_ids, True)


def _completion(seq: Sequence, text: str, token_ids: list[int], first: int, end: int,
                delta_text: str, delta_token_ids: list[int], changed: bool) -> CompletionOutput:
    """The choice with its logprobs of tokens first..end (when it asked for them)."""
    wants_logprobs = seq.params.logprobs is not None
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=token_ids,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=seq.output_logprobs[first:end] if wants_logprobs else None,
        top_logprobs=seq.output_top_logprobs[first:end] if wants_logprobs else None,
        delta_text=delta_text,
        delta_token_ids=delta_token_ids,
        changed=changed,
    )
