"""Embeddings, /pooling and /classify: a request's inputs through the engine, and
the outputs in each route's shape.

Each input is an engine request of its own, so inputs of one request and of
many requests batch together in the engine's steps (service/serving/pooling.py).
An embedding goes out as JSON numbers (a float32 read back from its shortest
decimal is the same float32) or, with encoding_format "base64", as OpenAI sends
it: the little-endian float32 bytes, base64-encoded.
"""

from __future__ import annotations

import base64
import time
from functools import partial

import numpy as np
from starlette.requests import Request

from service.errors import bad_request
from service.protocol.pooling import (
    ClassificationData, ClassificationRequest, ClassificationResponse, Embedding,
    EmbeddingRequest, EmbeddingResponse, PoolingData, PoolingRequest, PoolingResponse,
    PoolingUsage,
)
from service.serving.lanes import unless_gone
from service.serving.pooling import (
    check_request, embed_items, input_items, pooling_params, submit, truncation,
)
from service.serving.state import ServiceState


def usage(outputs) -> PoolingUsage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    return PoolingUsage(prompt, prompt)


def encoded(vector, encoding_format: str) -> list[float] | str:
    """A 1-D float tensor as JSON numbers, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        raw = np.ascontiguousarray(vector.float().numpy(), dtype="<f4").tobytes()
        return base64.b64encode(raw).decode("ascii")
    return vector.tolist()


async def run(request: Request, state: ServiceState, body, prepare, params, *,
              id_prefix: str, param: str):
    """Prepare the inputs on a prep thread, run them, and collect every output:
    (request id, outputs), the outputs None when the client left."""
    items = await unless_gone(request, state.off_loop(prepare))
    job = submit(state, request, body, items, params, id_prefix=id_prefix, param=param)
    return job.request_id, await job.collect(request)


async def embed(request: Request, state: ServiceState, info,
                body: EmbeddingRequest) -> EmbeddingResponse | None:
    """POST /v1/embeddings: one embedding per input."""
    check_request(state, request, body)
    params = _embed_params(state, info, body)
    request_id, outputs = await run(request, state, body, _preparer(state, info, body), params,
                                    id_prefix="embd", param="input")
    if outputs is None:
        return None
    data = [Embedding(i, encoded(o.outputs.data, body.encoding_format))
            for i, o in enumerate(outputs)]
    return EmbeddingResponse(request_id, int(time.time()), state.model_name, data,
                             usage(outputs))


def _embed_params(state: ServiceState, info, body: EmbeddingRequest):
    """The engine's settings of an embedding; `dimensions` within the model's width."""
    if body.dimensions is not None and not 1 <= body.dimensions <= info.size:
        raise bad_request(f"dimensions={body.dimensions} must be in [1, {info.size}] (this "
                          f"model's embeddings have {info.size})", param="dimensions")
    return pooling_params(state, task="embed", normalize=body.normalize, dimensions=body.dimensions)


def _preparer(state: ServiceState, info, body):
    """The function that turns the request's inputs into token ids (on a prep thread)."""
    items = input_items(state, body.input, "input")
    prompt_name = getattr(body, "prompt_name", None)
    if prompt_name is not None and not all(isinstance(item, str) for item in items):
        raise bad_request("prompt_name applies to texts; token ids are run as they are",
                          param="prompt_name")
    return partial(embed_items, state, info, items,
                   truncate=truncation(info, body.truncate_prompt_tokens),
                   prompt_name=prompt_name, param="input")


async def pool(request: Request, state: ServiceState, info,
               body: PoolingRequest) -> PoolingResponse | None:
    """POST /pooling: the model's own output per input (an embedding, or class scores)."""
    check_request(state, request, body)
    task = body.task or info.task
    if task != info.task:
        raise bad_request(f"this model does {info.task!r}, not {task!r}", param="task")
    if task == "embed":
        _refuse_set(body, "use_activation", "classify")
        params = _embed_params(state, info, body)
    else:
        for name in ("dimensions", "normalize", "prompt_name"):
            _refuse_set(body, name, "embed")
        params = pooling_params(state, task="classify", use_activation=body.use_activation)
    request_id, outputs = await run(request, state, body, _preparer(state, info, body), params,
                                    id_prefix="pool", param="input")
    if outputs is None:
        return None
    data = [PoolingData(i, encoded(o.outputs.data, body.encoding_format))
            for i, o in enumerate(outputs)]
    return PoolingResponse(request_id, int(time.time()), state.model_name, data,
                           usage(outputs))


def _refuse_set(body, name: str, task: str) -> None:
    """A field of another task, set: refused rather than ignored."""
    if getattr(body, name) is not None:
        raise bad_request(f"{name} applies to task {task!r} only", param=name)


async def classify(request: Request, state: ServiceState, info,
                   body: ClassificationRequest) -> ClassificationResponse | None:
    """POST /classify: each input's label probabilities and its likeliest label."""
    check_request(state, request, body)
    params = pooling_params(state, task="classify", use_activation=body.use_activation)
    request_id, outputs = await run(request, state, body, _preparer(state, info, body), params,
                                    id_prefix="classify", param="input")
    if outputs is None:
        return None
    data = [_classified(info, i, o.outputs.data) for i, o in enumerate(outputs)]
    return ClassificationResponse(request_id, int(time.time()), state.model_name, data,
                                  usage(outputs))


def _classified(info, index: int, probs) -> ClassificationData:
    values = probs.tolist()
    best = int(probs.argmax())
    labels = info.labels or []
    return ClassificationData(index, labels[best] if best < len(labels) else None, values,
                              len(values))
