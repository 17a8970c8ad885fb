"""The engine's side of LoRA: requests name adapters, and an adapter removed
while requests still run under it stays until the last of them ends.

The runner holds the adapters' weights (engine/model/lora/); this keeps what
the frontend decides: whether the engine serves adapters at all, what a
request's adapter adds to its first block's hash (its content's digest, so
two adapters never share a block, and one adapter read from two paths or by
two replicas does), and which removals wait.
"""

from __future__ import annotations

from engine.errors import ValidationError
from engine.model.lora.request import LoRARequest


class LoRAAdapters:
    def __init__(self, runner, enabled: bool) -> None:
        self.runner = runner
        self.enabled = enabled
        self.pending: set[int] = set()  # removals waiting for their requests to end

    def admit(self, request: LoRARequest | None) -> tuple[int, bytes]:
        """(lora_id, hash key) of a new request's adapter; (0, b"") for the base."""
        if request is None:
            return 0, b""
        if not isinstance(request, LoRARequest):
            raise ValidationError(f"lora_request must be a LoRARequest, got {request!r}", "model")
        self.pending.discard(request.lora_int_id)  # asked for again: it stays
        return request.lora_int_id, self.add(request)

    def add(self, request: LoRARequest) -> bytes:
        """Read and check the adapter (held already: touched); its digest."""
        if not self.enabled:
            raise ValidationError(f"adapter {request.lora_name!r}: this engine serves no LoRA "
                                  "adapters (start it with enable_lora / --enable-lora)", "model")
        return self.runner.add_lora(request)

    def remove(self, lora_id: int, requests) -> bool:
        """Forget an adapter now, or when the last request under it ends;
        whether it was known."""
        known = any(r.lora_int_id == lora_id for r in self.runner.list_loras()) if self.enabled \
            else False
        if known and _in_use(lora_id, requests):
            self.pending.add(lora_id)
        elif known:
            self.runner.remove_lora(lora_id)
        return known

    def settle(self, requests) -> None:
        """After a step: carry out the removals nobody waits for any more."""
        for lora_id in [i for i in self.pending if not _in_use(i, requests)]:
            self.pending.discard(lora_id)
            self.runner.remove_lora(lora_id)

    def list(self) -> list[LoRARequest]:
        if not self.enabled:
            return []
        return [r for r in self.runner.list_loras() if r.lora_int_id not in self.pending]


def _in_use(lora_id: int, requests) -> bool:
    return any(seq.lora_id == lora_id for request in requests.values() for seq in request.seqs)
