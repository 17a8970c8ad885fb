"""`pagedserve serve` / `python -m service`: flags -> ServiceConfig -> uvicorn.

SIGTERM (Kubernetes stopping a pod) is a graceful drain: /health turns 503
so the load balancer stops sending, open streams run on for
--shutdown-grace-seconds, uvicorn then cancels what is left (aborting those
requests), the engine thread stops and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import uvicorn

from engine.args import add_engine_args, config_from_args
from service.config import ServiceConfig


def add_service_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("service")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--served-model-name", default=None,
                       help="the model id clients send (default: --model)")
    group.add_argument("--api-key", action="append", default=[], dest="api_keys",
                       help="accept this key (repeat for several); none means no auth")
    group.add_argument("--protect-health-and-metrics", action="store_true",
                       help="require a key for /health and /metrics too")
    group.add_argument("--share-prefix-cache-across-keys", action="store_true",
                       help="let different API keys share cached prefixes (timing side channel)")
    group.add_argument("--allowed-origin", action="append", default=[], dest="allowed_origins",
                       help="CORS: a browser origin allowed to call the API (repeatable)")
    group.add_argument("--max-request-body-bytes", type=int, default=4 << 20)
    group.add_argument("--max-waiting-requests", type=int, default=1024,
                       help="past this many queued requests, answer 429")
    group.add_argument("--shutdown-grace-seconds", type=float, default=30.0)
    group.add_argument("--log-prompts", action="store_true",
                       help="log prompt token ids (off by default: prompts are private)")
    group.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"))


def service_config_from_args(args: argparse.Namespace) -> ServiceConfig:
    return ServiceConfig(
        engine=config_from_args(args),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_keys=tuple(args.api_keys),
        protect_health_and_metrics=args.protect_health_and_metrics,
        share_prefix_cache_across_keys=args.share_prefix_cache_across_keys,
        allowed_origins=tuple(args.allowed_origins),
        max_request_body_bytes=args.max_request_body_bytes,
        max_waiting_requests=args.max_waiting_requests,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        log_prompts=args.log_prompts,
    )


class Server(uvicorn.Server):
    """uvicorn's server, with a drain flag set first and a clean exit after."""

    def __init__(self, config: uvicorn.Config, app) -> None:
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig: int, frame) -> None:
        state = getattr(self.app.state, "service", None)
        if state is not None:
            state.draining = True
        # uvicorn's own handler also records the signal and raises it again
        # once it has shut down, which would end the process with 143 rather
        # than 0 after a clean drain; so only its two flags are kept.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def serve(config: ServiceConfig, log_level: str = "info") -> int:
    from service.app import create_app

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    server = Server(uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level,
        timeout_graceful_shutdown=config.shutdown_grace_seconds,
        access_log=False,  # request lines only add noise; /metrics has the numbers
    ), app)
    server.run()
    return 0


def serve_command(args: argparse.Namespace) -> int:
    return serve(service_config_from_args(args), args.log_level)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve serve",
                                     description="serve a model over an OpenAI-compatible API")
    add_engine_args(parser)
    add_service_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return serve_command(args)
    except ValueError as exc:
        print(f"pagedserve serve: error: {exc}", file=sys.stderr)
        return 2
