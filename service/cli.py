"""`pagedserve serve` / `python -m service`: flags -> ServiceConfig -> uvicorn.

SIGTERM (Kubernetes stopping a pod) is a graceful drain:

    SIGTERM ─► /health 503 "draining", new requests 503; the listener stays open
            ─► open requests run on, up to --shutdown-grace-seconds
            ─► grace over: each still open ends with an error event, then [DONE]
               (a non-streamed one with a 503), and is aborted in the engine
            ─► uvicorn closes the listener, lets the last bytes go out
               (FLUSH_SECONDS), the engine thread stops, the process exits 0

A second Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys

import uvicorn
import yaml

from engine.args import add_engine_args, config_from_args
from engine.config import EngineConfig
from service.config import (
    GENERATION_CONFIGS, REASONING_PARSERS, TOOL_CALL_PARSERS, FleetConfig, LoRAModule,
    ServiceConfig,
)


def add_service_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("service")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--served-model-name", default=None,
                       help="the model id clients send (default: --model)")
    add_key_args(group)
    group.add_argument("--allowed-origin", action="append", default=[], dest="allowed_origins",
                       help="CORS: a browser origin allowed to call the API (repeatable)")
    group.add_argument("--max-request-body-bytes", type=int, default=4 << 20)
    group.add_argument("--header-timeout-seconds", type=float, default=10.0,
                       help="408 and close when a request's headers are not complete this "
                            "long after its first byte (a new connection's, after it opens)")
    group.add_argument("--body-timeout-seconds", type=float, default=30.0,
                       help="408 when a request body is not complete this long after its "
                            "headers (one deadline, however the bytes trickle in)")
    group.add_argument("--max-connections", type=int, default=2048,
                       help="open connections at most: past it the oldest idle one is "
                            "closed, or, none idle, the new one gets 503")
    group.add_argument("--refusal-rate", type=float, default=ServiceConfig.refusal_rate,
                       help="a client's refused requests (4xx) past --refusal-burst are "
                            "answered at this rate a second, the rest wait; 0: off")
    group.add_argument("--refusal-burst", type=int, default=ServiceConfig.refusal_burst,
                       help="refusals at once before pacing; as many more wait, then 429")
    group.add_argument("--trusted-proxy", action="append", default=[], dest="trusted_proxies",
                       help="an address or CIDR network whose X-Forwarded-For names the "
                            "client (repeatable; default: none)")
    group.add_argument("--prep-threads", type=int, default=4,
                       help="threads that render chat templates and tokenize")
    group.add_argument("--compile-threads", type=int, default=2,
                       help="threads that compile output constraints (JSON schemas, "
                            "regexes, grammars), apart, in turn by tenant (API key, else "
                            "client address), one running per tenant; one past 1 s goes on at "
                            "the lowest CPU priority")
    group.add_argument("--max-waiting-requests", type=int, default=1024,
                       help="past this many queued requests, answer 429")
    group.add_argument("--shutdown-grace-seconds", type=float, default=30.0)
    group.add_argument("--generation-config", choices=GENERATION_CONFIGS, default="auto",
                       help="defaults for sampling settings a request leaves out; auto: the "
                            "model's generation_config.json (SmolLM2: temperature 0.2, top_p "
                            "0.9), vllm: the API's own (temperature 1.0)")
    group.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="auto",
                       help='the tool-call format tool_choice "auto" reads; auto: from the chat '
                            "template (hermes: <tool_call>, llama3_json: <|python_tag|>), none: "
                            'refuse "auto" ("required" and named functions always work)')
    group.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                       help="split a thinking model's <think>...</think> out of the content "
                            "into reasoning_content (Qwen3: qwen3, DeepSeek-R1: deepseek_r1); "
                            "default: none, the thought stays in the content (as in vLLM)")
    add_lora_args(group)
    group.add_argument("--log-prompts", action="store_true",
                       help="log prompt token ids (off by default: prompts are private)")
    group.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"))


def add_key_args(group) -> None:
    """API keys and what each kind of key may do."""
    group.add_argument("--api-key", action="append", default=[], dest="api_keys",
                       help="accept this key (repeat for several; also PAGEDSERVE_API_KEYS, "
                            "comma-separated); none means no auth")
    group.add_argument("--admin-key", action="append", default=[], dest="admin_keys",
                       help="a key for admin routes (/reset_prefix_cache), which act on every "
                            "tenant; once any key is set, other keys get 403 there (also "
                            "PAGEDSERVE_ADMIN_KEYS)")
    group.add_argument("--protect-health-and-metrics", action="store_true",
                       help="require a key for /health and /metrics too")
    group.add_argument("--min-priority-non-admin", type=int,
                       default=ServiceConfig.min_priority_non_admin,
                       help="once any key is set, the most urgent (lowest) priority a request "
                            "without an admin key may ask for; lower gets 403 (-2147483648: "
                            "no floor, as vLLM)")
    group.add_argument("--open-kv-event-sources", action="store_true",
                       help="answer GET /kv_event_sources without a key once keys are set, for "
                            "a router that discovers pods and holds no key")
    group.add_argument("--share-prefix-cache-across-keys", action="store_true",
                       help="let different API keys share cached prefixes (timing side channel)")


def lora_module(text: str) -> LoRAModule:
    try:
        return LoRAModule.parse(text)
    except ValueError as exc:  # argparse shows this message, not "invalid value"
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_lora_args(group) -> None:
    """vLLM's service-side LoRA flags (the engine's own come from EngineConfig)."""
    group.add_argument("--lora-modules", nargs="+", action="extend", type=lora_module,
                       default=[], metavar="NAME=PATH",
                       help="LoRA adapters served from start-up, each under its name (the "
                            "request's `model`): name=path or a JSON object {\"name\": ..., "
                            "\"path\": ..., \"base_model_name\": ...}; needs --enable-lora")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                            f"(admin key); also {RUNTIME_LORA_ENV}=1 or true, as vLLM")


def runtime_lora_updating(args: argparse.Namespace) -> bool:
    """The flag, or vLLM's environment variable (read as vLLM reads it)."""
    env = os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")
    return bool(args.allow_runtime_lora_updating) or env


def add_fleet_args(parser: argparse.ArgumentParser) -> None:
    defaults = FleetConfig()  # one source for the defaults: the config's own
    group = parser.add_argument_group("fleet (all need --redis-url)")
    group.add_argument("--redis-url", default=None,
                       help="the fleet's Redis (redis://[:password@]host:port/db, rediss:// for "
                            "TLS; also PAGEDSERVE_REDIS_URL): record system prompts, warm the "
                            "popular ones before /health turns 200, publish presence. None: a "
                            "lone server")
    group.add_argument("--replica-id", default=None, help="default: host name and process id")
    group.add_argument("--advertise-url", default=None,
                       help="how peers and `pagedserve fleet` reach this replica "
                            "(default: http://HOST:PORT)")
    group.add_argument("--registry-min-seen", type=int, default=defaults.min_seen,
                       help="keep a system prompt once it was seen this often")
    group.add_argument("--registry-half-life-seconds", type=float,
                       default=defaults.half_life_seconds,
                       help="a prompt's popularity halves with this much disuse")
    group.add_argument("--registry-max-prefixes", type=int, default=defaults.max_prefixes,
                       help="prefixes kept per namespace in Redis, least popular dropped")
    group.add_argument("--registry-buffer-size", type=int, default=defaults.buffer_size,
                       help="sightings held while Redis is slow or down, then dropped")
    group.add_argument("--warm-max-prefixes", type=int, default=defaults.warm_max_prefixes)
    group.add_argument("--warm-max-blocks", type=int, default=None,
                       help="KV blocks warm-up may fill (default: a fifth of the pool)")
    group.add_argument("--warm-timeout-seconds", type=float,
                       default=defaults.warm_timeout_seconds,
                       help="readiness waits at most this long for the warm-up")
    group.add_argument("--warm-refresh-seconds", type=float, default=defaults.refresh_seconds,
                       help="while idle, warm newly popular prefixes this often")
    group.add_argument("--heartbeat-seconds", type=float, default=defaults.heartbeat_seconds,
                       help="presence refresh; the key lapses after three missed beats")


def fleet_config_from_args(args: argparse.Namespace) -> FleetConfig:
    return FleetConfig(
        redis_url=args.redis_url, replica_id=args.replica_id, advertise_url=args.advertise_url,
        min_seen=args.registry_min_seen, half_life_seconds=args.registry_half_life_seconds,
        max_prefixes=args.registry_max_prefixes, buffer_size=args.registry_buffer_size,
        warm_max_prefixes=args.warm_max_prefixes, warm_max_blocks=args.warm_max_blocks,
        warm_timeout_seconds=args.warm_timeout_seconds,
        refresh_seconds=args.warm_refresh_seconds, heartbeat_seconds=args.heartbeat_seconds,
    )


# The serving default of --max-num-batched-tokens on a CPU. Every running
# stream waits for the whole step, and a step with P prompt tokens costs about
# P times a one-token decode of the batch's weights: on a 2-core CPU 512 tokens
# of SmolLM2 take about a second, while the engine's offline default (8192)
# let one 8,000-token prompt stall every stream for ~19 s. Longer prompts are
# prefilled a chunk per step, interleaved with the running decodes; offline
# runs keep the larger default, where only throughput counts (vLLM likewise
# picks smaller budgets for its API server than for its offline LLM class).
CPU_SERVING_STEP_TOKENS = 512


def serving_step_tokens(device: str, runner: str = "generate") -> int:
    """The serving default of max_num_batched_tokens for the --device and --runner flags.

    A pooling model streams nothing, so no stream waits on a long step: it keeps
    the engine's default, where a batch of inputs runs in as few steps as it can.
    """
    from engine.model.placement import resolve_device  # torch: imported only when serving

    if runner == "generate" and resolve_device(EngineConfig(device=device)).type == "cpu":
        return CPU_SERVING_STEP_TOKENS
    return EngineConfig().max_num_batched_tokens


# Secrets come from the environment too (a Kubernetes Secret), so that they
# never show in the process list as flags would.
SECRET_ENV = {"api_keys": "PAGEDSERVE_API_KEYS", "admin_keys": "PAGEDSERVE_ADMIN_KEYS"}
REDIS_URL_ENV = "PAGEDSERVE_REDIS_URL"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def env_keys(name: str) -> list[str]:
    """Comma-separated keys from the environment variable `name` (blanks dropped)."""
    return [key.strip() for key in os.environ.get(name, "").split(",") if key.strip()]


def service_config_from_args(args: argparse.Namespace) -> ServiceConfig:
    if args.max_num_batched_tokens is None:  # not given: the serving default
        args.max_num_batched_tokens = serving_step_tokens(args.device, args.runner)
    if args.redis_url is None:
        args.redis_url = os.environ.get(REDIS_URL_ENV) or None
    return ServiceConfig(
        engine=config_from_args(args),
        fleet=fleet_config_from_args(args),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_keys=tuple(args.api_keys + env_keys(SECRET_ENV["api_keys"])),
        admin_keys=tuple(args.admin_keys + env_keys(SECRET_ENV["admin_keys"])),
        protect_health_and_metrics=args.protect_health_and_metrics,
        min_priority_non_admin=args.min_priority_non_admin,
        open_kv_event_sources=args.open_kv_event_sources,
        share_prefix_cache_across_keys=args.share_prefix_cache_across_keys,
        allowed_origins=tuple(args.allowed_origins),
        max_request_body_bytes=args.max_request_body_bytes,
        header_timeout_seconds=args.header_timeout_seconds,
        body_timeout_seconds=args.body_timeout_seconds,
        max_connections=args.max_connections,
        refusal_rate=args.refusal_rate,
        refusal_burst=args.refusal_burst,
        trusted_proxies=tuple(args.trusted_proxies),
        prep_threads=args.prep_threads,
        compile_threads=args.compile_threads,
        max_waiting_requests=args.max_waiting_requests,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        log_prompts=args.log_prompts,
        generation_config=args.generation_config,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        lora_modules=tuple(args.lora_modules),
        allow_runtime_lora_updating=runtime_lora_updating(args),
    )


# After the drain, how long uvicorn waits for responses to finish going out.
FLUSH_SECONDS = 5.0


class Server(uvicorn.Server):
    """uvicorn's server with our drain before its shutdown, and a clean exit after."""

    def __init__(self, config: uvicorn.Config, app, grace_seconds: float) -> None:
        super().__init__(config)
        self.app = app
        self.grace_seconds = grace_seconds
        self.drain_requested = False
        self.drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        # A signal handler: only flags here; on_tick starts the drain on the loop.
        # uvicorn's own handler also records the signal and raises it again
        # once it has shut down, which would end the process with 143 rather
        # than 0 after a clean drain; so that part is left out.
        state = getattr(self.app.state, "service", None)
        if self.drain_requested and sig == signal.SIGINT:
            self.should_exit = self.force_exit = True
        elif state is None:  # still starting: nothing to drain
            self.should_exit = True
        else:
            state.draining = True  # /health says so from this instant
            self.drain_requested = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_requested and self.drain_task is None:
            self.drain_task = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        try:
            await self.app.state.service.drain(self.grace_seconds)
        finally:
            self.should_exit = True


def serve(config: ServiceConfig, log_level: str = "info") -> int:
    from engine.model.model_info import prepare_model
    from service.app import create_app
    from service.guards.connections import uvicorn_options

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    prepare_model(config.engine)  # a GGUF's first start: its folder made in a child process
    app = create_app(config)
    server = Server(uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level,
        timeout_graceful_shutdown=FLUSH_SECONDS,  # the grace itself is our drain's
        access_log=False,  # request lines only add noise; /metrics has the numbers
        **uvicorn_options(config),  # header deadline, connection cap
    ), app, config.shutdown_grace_seconds)
    server.run()
    # uvicorn ends a failed start-up (a model or adapter that does not load)
    # quietly after logging it; the exit status says so too (uvicorn's own 3).
    return 0 if server.started else 3


def serve_command(args: argparse.Namespace) -> int:
    return serve(service_config_from_args(args), args.log_level)


def expand_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """--config FILE: its flags first, so that those on the command line win.

    The file is a YAML mapping of flag names to values (a ConfigMap in
    Kubernetes), as vLLM's `--config`: `max-model-len: 2048` or
    `max_model_len: 2048`; a list repeats the flag; true sets a switch, false
    clears it (its --no- form) or leaves it off.
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, rest = pre.parse_known_args(argv)
    if known.config is None:
        return argv
    with open(known.config, encoding="utf-8") as file:
        settings = yaml.safe_load(file) or {}
    if not isinstance(settings, dict):
        raise ValueError(f"{known.config} must hold a mapping of flag names to values")
    options = parser._option_string_actions
    flags: list[str] = []
    for name, value in settings.items():
        flag = "--" + str(name).replace("_", "-")
        if flag not in options:
            raise ValueError(f"{known.config}: {name!r} is not a flag of pagedserve serve")
        if value is True:
            flags.append(flag)
        elif value is False:
            negative = "--no-" + flag[2:]
            flags += [negative] if negative in options else []
        elif isinstance(value, list):
            for item in value:  # a mapping (a --lora-modules item) as JSON
                flags += [flag, json.dumps(item) if isinstance(item, dict) else str(item)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags + rest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve serve",
                                     description="serve a model over an OpenAI-compatible API")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="a YAML file of flags (max-model-len: 2048, ...); flags given on "
                             "the command line win")
    add_engine_args(parser)
    add_service_args(parser)
    add_fleet_args(parser)
    parser.set_defaults(max_num_batched_tokens=None)
    for action in parser._actions:
        if action.dest == "max_num_batched_tokens":
            action.help = (f"most tokens in one step; longer prompts are prefilled a chunk per "
                           f"step (default: {CPU_SERVING_STEP_TOKENS} on a CPU, where a step "
                           f"stalls every stream, {EngineConfig().max_num_batched_tokens} on a GPU "
                           f"and with --runner pooling)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        argv = expand_config(parser, argv)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"pagedserve serve: error: --config: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return serve_command(args)
    except ValueError as exc:
        print(f"pagedserve serve: error: {exc}", file=sys.stderr)
        return 2
