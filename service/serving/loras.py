"""The served LoRA adapters: name -> LoRARequest, and a request's `model` resolved.

    model == the served model's name (or absent)  -> None: the base model
    model == an adapter's name                      -> its LoRARequest
    anything else                                   -> 404 model_not_found

The names live here, not in the engine: the engine holds adapters' weights in
an LRU of --max-cpu-loras and may drop one, reading it again from its path
when a request needs it, so every request carries its whole LoRARequest.
Ids are handed out increasing and never reused: an adapter unloaded while
requests still run under it keeps its id in the engine until they end, and a
new adapter of the same name must not be taken for it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from engine.errors import ValidationError
from engine.frontend.async_engine import AsyncEngine, EngineDeadError
from engine.model.lora.request import LoRARequest
from service.config import LoRAModule
from service.errors import APIError, bad_request

logger = logging.getLogger(__name__)


class LoRARegistry:
    def __init__(self, base_name: str) -> None:
        self.base_name = base_name
        self.adapters: dict[str, LoRARequest] = {}  # in the order they were loaded
        self._ids = itertools.count(1)  # 0 is the base model (vLLM's convention)
        # Loads and unloads one at a time: a name checked free must still be
        # free once the engine has read the folder (which awaits).
        self._lock = asyncio.Lock()

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model; else 404."""
        if model is None or model == self.base_name:
            return None
        found = self.adapters.get(model)
        if found is None:
            served = ", ".join(repr(name) for name in [self.base_name, *self.adapters])
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{served}", param="model", code="model_not_found")
        return found

    def model_name(self, lora: LoRARequest | None) -> str:
        """What answers call the model: the adapter's name, or the base model's."""
        return self.base_name if lora is None else lora.lora_name

    async def start(self, engine: AsyncEngine, modules: tuple[LoRAModule, ...]) -> None:
        """Load --lora-modules; one that does not fit stops the start-up, naming it."""
        for module in modules:
            try:
                await self.load(engine, module.name, module.path, module.base_model_name)
            except APIError as exc:
                raise ValueError(f"--lora-modules {module.name}={module.path}: "
                                 f"{exc.message}") from None

    async def load(self, engine: AsyncEngine, name: str, path: str,
                   base_model_name: str | None = None) -> LoRARequest:
        """Read and check the adapter in the engine, then serve it under `name`."""
        async with self._lock:
            if name == self.base_name:
                raise bad_request(f"{name!r} is the served model's name", param="lora_name")
            if name in self.adapters:
                raise bad_request(f"The lora adapter {name!r} has already been loaded.",
                                  param="lora_name")
            request = LoRARequest(name, next(self._ids), path, base_model_name)
            try:
                await engine.call(lambda e: e.add_lora(request))
            except ValidationError as exc:  # the folder does not fit this model
                raise bad_request(exc.message, param=exc.param or "lora_path") from None
            except OSError as exc:  # unreadable files the engine's checks let through
                raise bad_request(f"{path}: {exc}", param="lora_path") from None
            except EngineDeadError as exc:
                raise APIError(503, str(exc), code="engine_dead") from None
            self.adapters[name] = request
        logger.info("LoRA adapter %r (id %d) loaded from %s", name, request.lora_int_id, path)
        return request

    async def unload(self, engine: AsyncEngine, name: str,
                     lora_int_id: int | None = None) -> LoRARequest:
        """Stop serving `name`: new requests get 404 at once; those running
        under it finish first (the engine defers the removal until they end)."""
        async with self._lock:
            request = self.adapters.get(name)
            if request is None:
                raise APIError(404, f"The lora adapter {name!r} cannot be found.",
                               param="lora_name", code="model_not_found")
            if lora_int_id is not None and lora_int_id != request.lora_int_id:
                raise bad_request(f"The lora adapter {name!r} has lora_int_id "
                                  f"{request.lora_int_id}, not {lora_int_id}",
                                  param="lora_int_id")
            del self.adapters[name]
            try:
                await engine.call(lambda e: e.remove_lora(request.lora_int_id))
            except EngineDeadError as exc:
                raise APIError(503, str(exc), code="engine_dead") from None
        logger.info("LoRA adapter %r (id %d) unloaded", name, request.lora_int_id)
        return request
