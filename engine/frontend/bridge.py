"""What crosses between the asyncio side and the engine thread (async_engine.py):
commands in, stats snapshots out, and the errors a caller is refused with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a fault, or shutdown): no request can be served."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later."""


@dataclass(frozen=True)
class Command:
    """Work for the engine thread, run between two steps."""

    run: Callable[[], None]
    adds: str | None = None  # the request id this command adds, if it adds one


@dataclass(frozen=True)
class EngineStats:
    """What the engine looked like after its latest step (read from any thread)."""

    counters: dict[str, int] = field(default_factory=dict)
    offload: dict | None = None  # LLMEngine.offload_stats(): the KV tiers, when there are any
    step_seconds: float = 0.0  # wall time of the latest non-empty step
    num_steps: int = 0
