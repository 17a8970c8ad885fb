"""What the engine hands back for a request (vLLM-compatible names).

A request's `SamplingParams.output_kind` says what it gets, as in vLLM:

    CUMULATIVE  every step that moved it; `text`, `token_ids` and logprobs are
                everything so far (copied each step: O(n^2) over a stream)
    DELTA       every step that moved it; `text`, `token_ids` and logprobs are
                only what this step added, and only the choices that changed
    FINAL_ONLY  one output, when the whole request (every choice) finished

In every kind `delta_text` and `delta_token_ids` hold what the consumer has not
seen yet: this step's part (DELTA: the same as `text` and `token_ids`), or the
whole choice in a FINAL_ONLY output. `changed` says whether a choice grew or
finished in this step: with CUMULATIVE and n > 1 every choice rides along, and a
streaming client sends on only the changed. `RequestOutput.add` folds DELTA
outputs into a whole one (vLLM's name), for a consumer that wants the answer
at the end but sees every step, as the service does to time each token.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # each output holds everything so far
    DELTA = 1  # each output holds only what is new
    FINAL_ONLY = 2  # one output, when the request finished


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None  # logprob of each generated token
    top_logprobs: list[list[tuple[int, float]]] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    changed: bool = True

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Logprob:
    """A token's logprob at a prompt position and its rank there (1: the likeliest)."""

    logprob: float
    rank: int


# vLLM's shape: None for the first prompt token (nothing scores it), then per position
# {prompt token: its Logprob, then the top-k by rank} (k entries when it is among them).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # SamplingParams.prompt_logprobs: once the prefill is done (a DELTA output carries
    # them once, the first after it; CUMULATIVE every output; FINAL_ONLY the last).
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, delta: "RequestOutput") -> None:
        """Fold a later DELTA output of the same request into this one, in place:
        each choice it carries grows by its new text, tokens and logprobs."""
        choices = {c.index: c for c in self.outputs}
        for new in delta.outputs:
            whole = choices.get(new.index)
            if whole is None:
                whole = choices[new.index] = copy.deepcopy(new)
                self.outputs.append(whole)
                continue
            whole.text += new.text
            whole.token_ids.extend(new.token_ids)
            if new.logprobs is not None:  # extended in place: no copy of what came before
                whole.logprobs.extend(new.logprobs)
                whole.top_logprobs.extend(new.top_logprobs)
            whole.finish_reason, whole.stop_reason = new.finish_reason, new.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished = delta.finished
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


@dataclass
class PoolingOutput:
    """A pooling request's answer: `data` is a 1-D float32 tensor on the host.
    Read it as vLLM's outputs name it: an embedding, a classifier's per-label
    probabilities, or a pair's score."""

    data: object  # torch.Tensor (this module imports no torch)

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def probs(self) -> list[float]:
        return self.data.tolist()

    @property
    def score(self) -> float:
        return float(self.data[0])


@dataclass
class PoolingRequestOutput:
    """What a pooling request gets: one output, when its prompt has been computed."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    num_cached_tokens: int = 0
