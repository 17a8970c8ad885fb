"""POST /v1/chat/completions/render and /v1/completions/render: a request's token ids
without generating, in vLLM's shape, for a KV-cache-aware router.

vllm-router's kv_aware policy posts the client's body here to learn which
tokens the request will run, then sends it to the replica whose KV events
(engine/core/kv_events.py) show the longest cached prefix of them. So the
token ids must be exactly the serving path's: both routes run the same
preparation as chat and completions (`prepare` of service/serving/chat.py
and of completions.py: the chat template, tools, tokenization, size and
constraint checks) and the same validation (ServiceState.validate), behind
the same auth, and answer the same errors. Nothing reaches the engine.

vLLM answers a GenerateRequest for chat and a list of them for completions
(one per prompt):

    {"request_id": "...", "token_ids": [...], "sampling_params": {...},
     "model": "...", "stream": false, "cache_salt": null}

`cache_salt` is the tenant's tag that the KV events carry (kv_events.tenant_tag),
never the salt itself: the tag is one-way.
"""

from __future__ import annotations

import dataclasses

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine.core.block_hash import salt_digest
from engine.core.kv_events import tenant_tag
from engine.model.lora.request import LoRARequest
from engine.sampling_params import SamplingParams
from service.serving import chat, completions
from service.serving.state import ServiceState, new_id

# SamplingParams fields that are the engine's business, not the request's.
INTERNAL_FIELDS = ("output_kind",)


async def chat_render(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    prepared = await chat.prepare(request, state)
    [params], salt, lora = state.validate(request, prepared.body, [prepared.token_ids],
                                          **prepared.admission_args())
    return _json(_generate_request(state, "chatcmpl", prepared.token_ids, params, salt,
                                   prepared.body.stream, lora))


async def completion_render(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    body, prompts, constraint = await completions.prepare(request, state)
    all_params, salt, lora = state.validate(request, body, prompts,
                                            **completions.admission_args(body, constraint))
    return _json([_generate_request(state, "cmpl", token_ids, params, salt, body.stream, lora)
                  for token_ids, params in zip(prompts, all_params)])


def _generate_request(state: ServiceState, prefix: str, token_ids: list[int],
                      params: SamplingParams, salt: str | None, stream: bool,
                      lora: LoRARequest | None) -> dict:
    return {
        "request_id": new_id(prefix),
        "token_ids": token_ids,
        "sampling_params": sampling_dict(params),
        "model": state.loras.model_name(lora),  # an adapter's name selects it, as in serving
        "stream": bool(stream),
        "cache_salt": tenant_tag(salt_digest(salt)) if salt else None,
    }


def sampling_dict(params: SamplingParams) -> dict:
    """SamplingParams as vLLM names them; a constraint as its one set field."""
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
              if f.name not in INTERNAL_FIELDS}
    constraint = fields.pop("structured_outputs")
    if constraint is not None:
        fields["structured_outputs"] = {f.name: getattr(constraint, f.name)
                                        for f in dataclasses.fields(constraint)
                                        if getattr(constraint, f.name) not in (None, False)}
    return fields


def _json(value) -> Response:
    return Response(msgspec.json.encode(value), media_type="application/json")
