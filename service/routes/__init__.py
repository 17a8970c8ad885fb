"""HTTP routes, one module per endpoint family; `app_routes(config)` is the app's table."""

from functools import wraps

from starlette.routing import Mount, Route

from service.config import ServiceConfig
from service.routes import (
    admin, chat, completions, discovery, embeddings, health, lora, models, pooling, render,
    responses, tokenize, web,
)
from service.serving.pooling import refuse_pooling


def generative(handler):
    """A route that generates: on a pooling server (--runner pooling), a 400 that
    says which routes it serves, before the body is read."""

    @wraps(handler)
    async def route(request):
        refuse_pooling(request.app.state.service, request.url.path)
        return await handler(request)

    return route


ROUTES = [
    Route("/v1/chat/completions", generative(chat.create), methods=["POST"]),
    Route("/v1/completions", generative(completions.create), methods=["POST"]),
    # OpenAI's Responses API on the chat machinery; nothing stored (store=false).
    Route("/v1/responses", generative(responses.create), methods=["POST"]),
    # vLLM's render routes: a request's token ids, for a KV-cache-aware router.
    Route("/v1/chat/completions/render", generative(render.chat_render), methods=["POST"]),
    Route("/v1/completions/render", generative(render.completion_render), methods=["POST"]),
    # Pooling models (--runner pooling): OpenAI's embeddings, vLLM's pooling routes,
    # Jina's and Cohere's rerank; on a generative server each answers a 400.
    Route("/v1/embeddings", embeddings.create, methods=["POST"]),
    Route("/pooling", pooling.pooling, methods=["POST"]),
    Route("/classify", pooling.classify, methods=["POST"]),
    Route("/score", pooling.score, methods=["POST"]),
    Route("/v1/score", pooling.score, methods=["POST"]),
    Route("/rerank", pooling.rerank, methods=["POST"]),
    Route("/v1/rerank", pooling.rerank, methods=["POST"]),
    Route("/v2/rerank", pooling.rerank, methods=["POST"]),
    Route("/tokenize", tokenize.tokenize, methods=["POST"]),
    Route("/detokenize", tokenize.detokenize, methods=["POST"]),
    Route("/v1/models", models.list_models, methods=["GET"]),
    # Model ids may hold slashes ("org/name"), hence the path converter.
    Route("/v1/models/{model_id:path}", models.retrieve_model, methods=["GET"]),
    Route("/health", health.health, methods=["GET"]),
    # What vllm-router asks each pod it discovers (service/routes/discovery.py).
    Route("/get_server_info", discovery.server_info, methods=["GET"]),
    Route("/kv_event_sources", discovery.kv_event_sources, methods=["GET"]),
    Route("/live", health.live, methods=["GET"]),
    Route("/metrics", health.metrics, methods=["GET"]),
    Route("/reset_prefix_cache", admin.reset_prefix_cache, methods=["POST"]),
    Route("/openapi.json", admin.openapi, methods=["GET"]),
    Route("/", web.index, methods=["GET"]),
    Mount("/web", app=web.web_files(), name="web"),
]

# vLLM's run-time adapter routes, only with --allow-runtime-lora-updating (else
# they do not exist: 404, as any unknown path); admin key (service/guards/auth.py).
RUNTIME_LORA_ROUTES = (
    Route("/v1/load_lora_adapter", lora.load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", lora.unload_lora_adapter, methods=["POST"]),
)


def app_routes(config: ServiceConfig) -> list:
    """The routes this configuration serves."""
    runtime = list(RUNTIME_LORA_ROUTES) if config.allow_runtime_lora_updating else []
    return [*runtime, *ROUTES]
