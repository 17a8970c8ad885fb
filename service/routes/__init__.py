"""HTTP routes, one module per endpoint family; `app_routes(config)` is the app's table."""

from starlette.routing import Mount, Route

from service.config import ServiceConfig
from service.routes import (
    admin, chat, completions, discovery, health, lora, models, render, responses, tokenize, web,
)

ROUTES = [
    Route("/v1/chat/completions", chat.create, methods=["POST"]),
    Route("/v1/completions", completions.create, methods=["POST"]),
    # OpenAI's Responses API on the chat machinery; nothing stored (store=false).
    Route("/v1/responses", responses.create, methods=["POST"]),
    # vLLM's render routes: a request's token ids, for a KV-cache-aware router.
    Route("/v1/chat/completions/render", render.chat_render, methods=["POST"]),
    Route("/v1/completions/render", render.completion_render, methods=["POST"]),
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
