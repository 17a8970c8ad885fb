"""/openapi.json, generated from the msgspec Structs that validate requests.

Because the schema comes from the same types the server decodes with, a
client (or a fuzzer) that follows it sends exactly what the server accepts.
"""

from __future__ import annotations

import msgspec

from service.protocol.replies import (
    ChatCompletionChunk, ChatCompletionResponse, CompletionResponse, ErrorResponse, Health,
    ModelCard, ModelList,
)
from service.protocol.pooling import (
    ClassificationRequest, ClassificationResponse, EmbeddingRequest, EmbeddingResponse,
    PoolingRequest, PoolingResponse, RerankRequest, RerankResponse, ScoreRequest, ScoreResponse,
)
from service.protocol.requests import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
)
from service.responses.protocol import ResponseObject, ResponsesRequest

REF = "#/components/schemas/{name}"


def _ref(kind: type) -> dict:
    return {"$ref": REF.format(name=kind.__name__)}


def _json(kind: type) -> dict:
    return {"application/json": {"schema": _ref(kind)}}


def _errors(*statuses: int) -> dict:
    return {str(s): {"description": "error", "content": _json(ErrorResponse)} for s in statuses}


def _generation(request: type, response: type, summary: str) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {
                    "description": "the completion, or an event stream of chunks when stream=true",
                    "content": {
                        **_json(response),
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(400, 401, 404, 408, 413, 415, 429, 503),
            },
        }
    }


# vLLM's GenerateRequest, as the render routes answer it (service/routes/render.py).
GENERATE_REQUEST = {"type": "object", "required": ["request_id", "token_ids", "sampling_params"],
                    "properties": {
    "request_id": {"type": "string"},
    "token_ids": {"type": "array", "items": {"type": "integer"}},
    "sampling_params": {"type": "object"},
    "model": {"type": "string"},
    "stream": {"type": "boolean"},
    "cache_salt": {"type": ["string", "null"]}}}


def _render(request: type, one_per_prompt: bool) -> dict:
    schema = {"type": "array", "items": GENERATE_REQUEST} if one_per_prompt else GENERATE_REQUEST
    return {"post": {
        "summary": "The request's token ids and sampling parameters, without generating",
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {"description": "vLLM's GenerateRequest" + (" per prompt" if one_per_prompt
                                                                else ""),
                    "content": {"application/json": {"schema": schema}}},
            **_errors(400, 401, 404, 408, 413, 415)}}}


def _plain(summary: str, request: type, properties: dict) -> dict:
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": _json(request)},
                     "responses": {"200": {"description": "the answer", "content": {
                         "application/json": {"schema": {"type": "object",
                                                         "properties": properties}}}},
                                   **_errors(400, 401, 404, 413, 415)}}}


def _lora_route(summary: str, properties: dict, required: list[str], errors) -> dict:
    """A run-time LoRA route: a small JSON body, vLLM's plain-text success line."""
    body = {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}
    return {"post": {"summary": summary,
                     "requestBody": {"required": True,
                                     "content": {"application/json": {"schema": body}}},
                     "responses": {"200": {"description": "Success: ...", "content": {
                         "text/plain": {"schema": {"type": "string"}}}},
                                   **_errors(*errors)}}}


def _runtime_lora_paths() -> dict:
    """--allow-runtime-lora-updating only: the routes exist only then (service/routes/lora.py)."""
    name = {"type": "string", "minLength": 1}
    load = _lora_route("Serve a LoRA adapter (a PEFT folder) under a model name",
                       {"lora_name": name, "lora_path": name}, ["lora_name", "lora_path"],
                       (400, 401, 403, 413, 415, 503))
    unload = _lora_route("Stop serving a LoRA adapter (running requests finish)",
                         {"lora_name": name, "lora_int_id": {"type": "integer", "minimum": 1}},
                         ["lora_name"], (400, 401, 403, 404, 413, 415, 503))
    return {"/v1/load_lora_adapter": load, "/v1/unload_lora_adapter": unload}


def _pooled(request: type, response: type, summary: str) -> dict:
    """A pooling route (--runner pooling only): JSON in, JSON out."""
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": _json(request)},
                     "responses": {"200": {"description": "the answer",
                                           "content": _json(response)},
                                   **_errors(400, 401, 404, 408, 413, 415, 429, 503)}}}


def _generation_paths() -> dict:
    return {
        "/v1/chat/completions": _generation(
            ChatCompletionRequest, ChatCompletionResponse, "Chat completion"),
        "/v1/completions": _generation(CompletionRequest, CompletionResponse, "Text completion"),
        "/v1/responses": _generation(ResponsesRequest, ResponseObject,
                                     "A response (OpenAI's Responses API; nothing stored)"),
        "/v1/chat/completions/render": _render(ChatCompletionRequest, False),
        "/v1/completions/render": _render(CompletionRequest, True),
    }


def _pooling_paths() -> dict:
    rerank = _pooled(RerankRequest, RerankResponse,
                     "Documents by relevance to a query, best first (Jina's and Cohere's shape)")
    score = _pooled(ScoreRequest, ScoreResponse, "A score per (text_1, text_2) pair")
    return {
        "/v1/embeddings": _pooled(EmbeddingRequest, EmbeddingResponse,
                                  "Embeddings (an embedding model)"),
        "/pooling": _pooled(PoolingRequest, PoolingResponse, "The model's output per input"),
        "/classify": _pooled(ClassificationRequest, ClassificationResponse,
                             "Label probabilities per input (a classifier)"),
        "/score": score, "/v1/score": score,
        "/rerank": rerank, "/v1/rerank": rerank, "/v2/rerank": rerank,
    }


def build_openapi(title: str, version: str, runtime_lora: bool = False,
                  pooling: bool = False) -> dict:
    """The served API: the generation routes, or with `pooling` (--runner pooling)
    the pooling routes, and what every server serves."""
    kinds = ([EmbeddingRequest, EmbeddingResponse, PoolingRequest, PoolingResponse,
              ClassificationRequest, ClassificationResponse, ScoreRequest, ScoreResponse,
              RerankRequest, RerankResponse] if pooling else
             [ChatCompletionRequest, CompletionRequest, ChatCompletionResponse,
              ChatCompletionChunk, CompletionResponse, ResponsesRequest, ResponseObject])
    _, components = msgspec.json.schema_components(
        [*kinds, ErrorResponse, Health, ModelCard, ModelList, TokenizeRequest,
         DetokenizeRequest], ref_template=REF)
    paths = {
        **(_pooling_paths() if pooling else _generation_paths()),
        "/tokenize": _plain("A prompt or a chat as the token ids serving runs", TokenizeRequest,
                            {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                             "tokens": {"type": "array", "items": {"type": "integer"}},
                             "token_strs": {"type": "array", "items": {"type": "string"}}}),
        "/detokenize": _plain("Token ids back to text", DetokenizeRequest,
                              {"prompt": {"type": "string"}}),
        "/v1/models": {"get": {"summary": "Served models", "responses": {
            "200": {"description": "the model list", "content": _json(ModelList)},
            **_errors(401)}}},
        "/v1/models/{model_id}": {"get": {
            "summary": "One served model",
            "parameters": [{"name": "model_id", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "responses": {
                "200": {"description": "the model card", "content": _json(ModelCard)},
                **_errors(401, 404)}}},
        "/health": {"get": {"summary": "Readiness: 503 while warming, draining or dead",
                            "responses": {
            "200": {"description": "ready", "content": _json(Health)},
            "503": {"description": "not ready", "content": _json(Health)}}}},
        "/live": {"get": {"summary": "Liveness: 503 only once the engine is dead", "responses": {
            "200": {"description": "alive", "content": _json(Health)},
            "503": {"description": "dead", "content": _json(Health)}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
            "200": {"description": "text exposition format",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/reset_prefix_cache": {"post": {"summary": "Drop cached KV blocks no request holds",
                                         "responses": {
            "200": {"description": "done",
                    "content": {"application/json": {"schema": {"type": "object"}}}},
            **_errors(401, 403, 503)}}},
        **(_runtime_lora_paths() if runtime_lora else {}),
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
