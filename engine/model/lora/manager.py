"""Which adapters the runner holds, and which slot each of a step's rows reads.

Two levels, as vLLM's --max-cpu-loras and --max-loras:

    host cache   up to max_cpu_loras adapters read from disk, least recently
                 used dropped first; a dropped one is read again from its path
                 when a request needs it (the manager remembers every
                 LoRARequest it was given until `remove`)
    slots        max_loras places in every projection's LoRAStack
                 (engine/model/lora/stacks.py): the adapters a step can mix.
                 The scheduler admits at most that many distinct adapters
                 into the running batch (engine/core/scheduler.py), so a
                 step always finds a slot for each; a slot whose adapter the
                 step does not use is refilled, least recently used first.

`prepare` runs before every forward pass: it puts the step's adapters into
slots and sets the row -> slot map that every stack reads.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from engine.errors import ValidationError
from engine.model.lora.request import LoRARequest
from engine.model.layers.activation import MLP
from engine.model.lora.adapter import SLICES, LoRAAdapter, load_adapter
from engine.model.lora.stacks import LoRAContext, LoRAStack


class LoRAManager:
    def __init__(self, config, model, kernels, dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        self.args, self.partition, self.dtype, self.device = model.args, model.partition, dtype, device
        self.context = LoRAContext()
        self.stacks = _install(model, self.context, kernels, config.max_loras, config.max_lora_rank,
                               dtype, device)
        model.layer_stack.lora = self.context  # the fused layer op yields to the modules when rows adapt
        self.cache: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.known: dict[int, LoRARequest] = {}
        self.slots: list[int | None] = [None] * config.max_loras
        self.slot_used = [0] * config.max_loras  # the step that last read each slot
        self.steps = 0

    # -- adapters ------------------------------------------------------------------
    def add(self, request: LoRARequest) -> bytes:
        """Read and check an adapter (ValidationError if it does not fit), or
        touch it when it is held already; its digest."""
        known = self.known.get(request.lora_int_id)
        if known is not None and (known.lora_path, known.lora_name) != (request.lora_path,
                                                                         request.lora_name):
            raise ValidationError(f"lora_int_id {request.lora_int_id} is adapter "
                                  f"{known.lora_name!r} already", "lora_int_id")
        return self._adapter(request).digest

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter: its host copy, its slot and its path."""
        found = self.known.pop(lora_id, None) is not None
        self.cache.pop(lora_id, None)
        for slot, held in enumerate(self.slots):
            if held == lora_id:
                self.slots[slot] = None
        return found

    def list(self) -> list[LoRARequest]:
        return list(self.known.values())

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        lora_id = request.lora_int_id
        adapter = self.cache.get(lora_id)
        if adapter is None:
            adapter = load_adapter(request, self.args, self.max_rank, self.dtype, self.partition)
            self.cache[lora_id] = adapter
            self.known[lora_id] = request
            while len(self.cache) > self.max_cpu_loras:
                self.cache.popitem(last=False)
        self.cache.move_to_end(lora_id)
        return adapter

    # -- one step ------------------------------------------------------------------
    def prepare(self, lora_ids: torch.Tensor | None) -> None:
        """Slots for the adapters of a step's rows (long [T], 0: the base;
        None: every row the base) and the row -> slot map the stacks read.
        Every tensor-parallel rank runs this on the same ids, adds and
        removes in the same order, so their slots agree."""
        self.steps += 1
        if lora_ids is None:
            self.context.row_ids = None
            return
        wanted = [i for i in torch.unique(lora_ids).tolist() if i]
        slot_of = self._assign(wanted)
        table = torch.full((max(wanted) + 1,), -1, dtype=torch.int32)
        for lora_id, slot in slot_of.items():
            table[lora_id] = slot
        self.context.row_ids = table.to(lora_ids.device)[lora_ids]

    def _assign(self, wanted: list[int]) -> dict[int, int]:
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} adapters; max_loras={self.max_loras}")
        slot_of = {lora_id: slot for slot, lora_id in enumerate(self.slots) if lora_id in wanted}
        spare = sorted((slot for slot, held in enumerate(self.slots) if held not in slot_of),
                       key=lambda slot: (self.slots[slot] is not None, self.slot_used[slot]))
        for lora_id in wanted:
            if lora_id not in slot_of:
                slot = spare.pop(0)
                self._fill(slot, self._adapter(self.known[lora_id]))
                slot_of[lora_id] = slot
        for slot in slot_of.values():
            self.slot_used[slot] = self.steps
        return slot_of

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        pieces: dict[tuple[int, str], list] = {}
        for (layer, module), (a, b) in adapter.weights.items():
            fused, index = SLICES[module]
            pieces.setdefault((layer, fused), []).append((index, a, b))
        for key, stack in self.stacks.items():
            stack.load(slot, pieces.get(key, []))
        self.slots[slot] = adapter.request.lora_int_id



def _install(model, context, kernels, slots, max_rank, dtype, device) -> dict:
    """A LoRAStack on every adaptable projection; (layer, name) -> stack."""
    stacks = {}
    head_dim, part = model.args.head_dim, model.partition
    q, kv = part.num_heads * head_dim, part.num_kv_heads * head_dim
    for index, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        projections = [("qkv_proj", attn.qkv_proj, [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]),
                       ("o_proj", attn.o_proj, [(0, attn.o_proj.out_features)])]
        if isinstance(mlp, MLP):
            width = part.intermediate_size
            projections += [("gate_up_proj", mlp.gate_up_proj, [(0, width), (width, 2 * width)]),
                            ("down_proj", mlp.down_proj, [(0, mlp.down_proj.out_features)])]
        for name, module, rows in projections:
            stack = LoRAStack(context, kernels, slots, max_rank, rows, module.in_features, dtype,
                              device)
            module.lora = stack
            stacks[index, name] = stack
    return stacks
