"""PoolingParams: what a pooling request asks of its vector (vLLM's names).

A pooling request computes its prompt and nothing after it: the answer is a
vector made from the prompt's last hidden states (engine/model/pooling/pooler.py),
not sampled tokens. What the request may choose is what happens to that vector
once it exists; which rows it is pooled from is the model's (its checkpoint's
sentence-transformers files, or its family's default).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ValidationError

TASKS = ("embed", "classify", "score")


@dataclass(frozen=True)
class PoolingParams:
    # embed: the pooled hidden state; classify: the head's per-label scores;
    # score: a cross-encoder's one score of a pair. None: the model's own task.
    task: str | None = None
    # embed: L2-normalise the vector (None: as the model's files say, else yes).
    normalize: bool | None = None
    # embed: keep the first `dimensions` values, then normalise (Matryoshka models).
    dimensions: int | None = None
    # classify: softmax (sigmoid for one label); score: sigmoid. None: yes.
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in TASKS:
            raise ValidationError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}",
                                  "task")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValidationError(f"{name} must be true or false, got {value!r}", name)
        dims = self.dimensions
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
            raise ValidationError(f"dimensions must be an integer >= 1, got {dims!r}",
                                  "dimensions")
