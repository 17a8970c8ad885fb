"""create_app(config): the starlette application around one engine.

    lifespan start:  load the model (off the loop) -> AsyncEngine thread starts -> live;
                     with --redis-url, ready once the fleet's warm-up is done
                     (service/fleet/replica.py)
    requests:        Guard (body limit, API key) -> CORS -> routes -> engine
    SIGTERM:         drain (service/cli.py): /health 503, open requests run on for the
                     grace, then end with an in-band 503
    lifespan stop:   stop admitting -> engine thread stops -> open requests get 503

The app holds its state on `app.state.service`; nothing lives at module level,
so a test can run several apps in one process.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial

import anyio
import msgspec
from sse_starlette.sse import AppStatus
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from engine.frontend.async_engine import AsyncEngine
from engine.frontend.chat_template import chat_template_source, renders_tools
from engine.frontend.llm_engine import LLMEngine
from engine.model.models.loader import load_sampling_defaults
from service.config import ServiceConfig
from service.errors import EXCEPTION_HANDLERS
from service.guards.auth import Guard
from service.metrics import Metrics
from service.openapi import build_openapi
from service.routes import app_routes
from service.serving.lanes import Prep
from service.serving.reasoning import check_tokenizer
from service.serving.state import ServiceState
from service.serving.token_bytes import TokenBytes
from service.tool_calls.registry import detect_parser

logger = logging.getLogger(__name__)

VERSION = "0.1.0"


async def start_service(config: ServiceConfig) -> ServiceState:
    """Load the model, start the engine thread, and build the server's state."""
    # Loading takes seconds, on the engine thread: the loop stays responsive,
    # and no other thread keeps an OpenMP pool (AsyncEngine.launch says why).
    metrics = Metrics()
    bridge = await AsyncEngine.launch(
        partial(LLMEngine, config.engine), max_waiting_requests=config.max_waiting_requests,
        on_step=metrics.engine_step.observe)
    engine = bridge.engine
    metrics.watch(bridge)
    # The engine's tokenizer, not a second copy (~20 MB resident): the engine
    # thread decodes with it and the prep lanes encode with it, and none of
    # them changes its settings (truncation, padding), so its Rust side is
    # only ever shared, as it already is between the prep lanes.
    tokenizer = engine.tokenizer
    try:
        check_tokenizer(config.reasoning_parser, tokenizer)
    except ValueError:
        bridge.shutdown()
        raise
    # A pooling model generates nothing: no logprobs to spell out in bytes, no
    # sampling defaults (service/serving/pooling.py serves it).
    generates = bridge.pooling is None
    state = ServiceState(
        # From here on the engine's resolved config is the only one.
        config=replace(config, engine=bridge.config),
        engine=bridge,
        tokenizer=tokenizer,
        token_bytes=(await anyio.to_thread.run_sync(TokenBytes, tokenizer)
                     if tokenizer is not None and generates else None),
        metrics=metrics,
        model_name=config.served_model_name or config.engine.model,
        sampling_defaults=(load_sampling_defaults(engine.model_path)
                           if config.generation_config == "auto" and generates else {}),
        renders_tools=renders_tools(tokenizer),
        tool_parser=detect_parser(chat_template_source(tokenizer), config.tool_call_parser),
        prep=Prep(config.prep_threads, config.compile_threads),
    )
    await _start_loras(state, bridge)
    logger.info("serving %s at http://%s:%d%s", state.model_name, config.host, config.port,
                "" if generates else f" (pooling: {bridge.pooling.task})")
    if state.sampling_defaults:
        logger.info("sampling defaults from the model's generation config: %s",
                    state.sampling_defaults)
    return state


async def _start_loras(state: ServiceState, bridge: AsyncEngine) -> None:
    """Serve --lora-modules from the start; one that does not fit stops the start-up."""
    if not state.config.engine.enable_lora:
        return
    state.metrics.watch_loras(state.loras)
    try:
        await state.loras.start(bridge, state.config.lora_modules)
    except BaseException:
        state.prep.close()
        bridge.shutdown()
        raise


def create_app(config: ServiceConfig) -> Starlette:
    # sse-starlette cancels every open stream the moment uvicorn sees SIGTERM.
    # We want the opposite: streams run on for the grace period (our own drain,
    # service/cli.py), then those still open end with an error event; uvicorn's
    # own shutdown only lets the last bytes out. The switch is the library's
    # own, process-wide.
    AppStatus.disable_automatic_graceful_drain()

    @asynccontextmanager
    async def lifespan(app: Starlette):
        state = await start_service(config)
        app.state.service = state
        if config.fleet.redis_url and state.engine.pooling is not None:
            # The fleet records and warms chats' system prompts: nothing a pooling
            # model serves. It runs alone, ready at once.
            logger.warning("--redis-url: a pooling server takes no part in the fleet's "
                           "prefix warm-up; it runs without the fleet")
        elif config.fleet.redis_url:
            # Imported here: redis-py is ~6 MB of a server's resident memory,
            # which a replica outside a fleet never uses.
            from service.fleet.replica import Fleet

            # Readiness waits for its warm-up; serving does not wait for Redis.
            state.fleet = Fleet(state, config.fleet)
            state.metrics.watch_fleet(state.fleet)
            state.fleet.start()
        try:
            yield
        finally:
            state.draining = True
            if state.fleet is not None:
                await state.fleet.stop()
            state.prep.close()
            state.engine.shutdown()

    # CORS sits outside the guard: browsers send preflights without a key, and
    # the guard's 401/413 answers need CORS headers for a page to read them.
    middleware = []
    if config.allowed_origins:
        middleware.append(Middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            # Any request header: SDKs add their own (the openai SDK's
            # x-stainless-*), and a page cannot leave them out.
            allow_headers=["*"],
        ))
    middleware.append(Middleware(Guard, config=config))
    app = Starlette(
        routes=app_routes(config),
        middleware=middleware,
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.openapi = msgspec.json.encode(
        build_openapi("pagedserve", VERSION, runtime_lora=config.allow_runtime_lora_updating,
                      pooling=config.engine.runner == "pooling"))
    return app
