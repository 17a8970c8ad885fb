"""What the engine hands back for a request (vLLM-compatible names).

Each step produces a `RequestOutput` for every request that made progress.
`text` and `token_ids` are cumulative; `delta_text` and `delta_token_ids`
hold only what this step added, which is what a streaming client sends on.
`changed` says whether a choice grew or finished in this step: a request with
n > 1 reports every choice, and a streaming client sends on only the changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
