"""HTTP routes, one module per endpoint family; `ROUTES` is the app's table."""

from starlette.routing import Mount, Route

from service.routes import admin, chat, completions, health, models, web

ROUTES = [
    Route("/v1/chat/completions", chat.create, methods=["POST"]),
    Route("/v1/completions", completions.create, methods=["POST"]),
    Route("/v1/models", models.list_models, methods=["GET"]),
    # Model ids may hold slashes ("org/name"), hence the path converter.
    Route("/v1/models/{model_id:path}", models.retrieve_model, methods=["GET"]),
    Route("/health", health.health, methods=["GET"]),
    Route("/live", health.live, methods=["GET"]),
    Route("/metrics", health.metrics, methods=["GET"]),
    Route("/reset_prefix_cache", admin.reset_prefix_cache, methods=["POST"]),
    Route("/openapi.json", admin.openapi, methods=["GET"]),
    Route("/", web.index, methods=["GET"]),
    Mount("/web", app=web.web_files(), name="web"),
]
