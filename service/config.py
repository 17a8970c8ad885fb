"""ServiceConfig: the HTTP side's settings, with the engine's config inside.

Like EngineConfig it is frozen and validated once; `create_app(config)` takes
it whole, so a test, the CLI and a deployment build a server the same way.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket

from dataclasses import dataclass, field

from engine.config import EngineConfig
from service.protocol.requests import PRIORITY_MAX, PRIORITY_MIN
from service.tool_calls.registry import PARSERS


GENERATION_CONFIGS = ("auto", "vllm")
# tool_choice "auto" reads the model's own tool-call format (service/tool_calls/registry.py):
# "auto" picks it from the chat template, "none" refuses tool_choice "auto".
TOOL_CALL_PARSERS = ("auto", "none", *PARSERS)  # the formats service/tool_calls/registry.py reads
# Thinking models' <think>...</think> as reasoning_content (service/serving/reasoning.py).
REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class FleetConfig:
    """The replica's part in the fleet: the Redis registry, warm-up, presence.

    No redis_url: no registry, no warm-up, no presence (a single server).
    """

    redis_url: str | None = None  # redis://[:password@]host:port/db or rediss:// (TLS)
    replica_id: str | None = None  # default: host name and process id (resolved_replica_id)
    advertise_url: str | None = None  # how peers reach this replica (default: host:port)
    # The registry keeps a system prompt only once it was seen this often.
    min_seen: int = 2
    half_life_seconds: float = 3600.0  # popularity halves with this much disuse
    max_prefixes: int = 1000  # per namespace in Redis; the least popular go first
    buffer_size: int = 1024  # sightings held while Redis is slow or down; then dropped
    # Warm-up before /health turns 200, and while idle afterwards.
    warm_max_prefixes: int = 32
    warm_max_blocks: int | None = None  # default: a fifth of the KV pool
    warm_timeout_seconds: float = 60.0
    refresh_seconds: float = 30.0  # idle re-warming of newly popular prefixes
    heartbeat_seconds: float = 5.0  # presence; the key expires after three missed beats

    def __post_init__(self) -> None:
        if self.redis_url is not None and not self.redis_url.startswith(
                ("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url={self.redis_url!r} must start with redis://, "
                             "rediss:// or unix://")
        for name in ("min_seen", "max_prefixes", "buffer_size", "warm_max_prefixes"):
            _check_int(name, getattr(self, name), minimum=1)
        if self.warm_max_blocks is not None:
            _check_int("warm_max_blocks", self.warm_max_blocks, minimum=0)
        for name in ("half_life_seconds", "warm_timeout_seconds", "refresh_seconds",
                     "heartbeat_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a number > 0")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


@dataclass(frozen=True)
class LoRAModule:
    """One --lora-modules item: an adapter served from start-up under `name`."""

    name: str
    path: str
    base_model_name: str | None = None  # if given, it must be the served model's name

    def __post_init__(self) -> None:
        for key in ("name", "path"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ValueError(f"a LoRA module needs a non-empty {key}, got {self!r}")

    @classmethod
    def parse(cls, text: str) -> "LoRAModule":
        """vLLM's two forms: `name=path`, or JSON `{"name", "path", "base_model_name"}`."""
        if not text.lstrip().startswith("{"):
            name, sep, path = text.partition("=")
            if not sep:
                raise ValueError(f"{text!r} is neither name=path nor a JSON object")
            return cls(name.strip(), path.strip())
        try:
            fields = json.loads(text)
            return cls(**fields)
        except (json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"{text!r} is not a JSON object with name, path and optionally "
                             f"base_model_name ({exc})") from None


def resolved_replica_id(fleet: FleetConfig) -> str:
    """The replica's id: the configured one, else host name and process id."""
    return fleet.replica_id or f"{socket.gethostname()}-{os.getpid()}"


def _proxy(value: str) -> str:
    """A --trusted-proxy as uvicorn reads it: an address or a network, checked here
    (uvicorn would take a typo for a literal that never matches)."""
    try:
        return str(ipaddress.ip_network(value.strip(), strict=False))
    except ValueError:
        raise ValueError(f"trusted_proxies: {value!r} is not an IP address or network") from None


@dataclass(frozen=True)
class ServiceConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # defaults to the model's name
    # Authentication: any of these keys is accepted as "Authorization: Bearer <key>".
    api_keys: tuple[str, ...] = ()
    # Admin routes (/reset_prefix_cache) take only these once any key is set.
    admin_keys: tuple[str, ...] = ()
    protect_health_and_metrics: bool = False  # by default probes and scrapers need no key
    # Once any key is set, a request without an admin key may ask for no priority
    # more urgent (lower) than this: a tenant may yield, not jump the queue.
    min_priority_non_admin: int = 0
    # GET /kv_event_sources without a key once keys are set: for a router that
    # discovers pods and holds no key (vllm-router in Kubernetes: the chart).
    open_kv_event_sources: bool = False
    # Tenants (API keys) get separate prefix caches unless this is set: a shared
    # cache lets one tenant time another's prompts (CVE-2025-46570).
    share_prefix_cache_across_keys: bool = False
    allowed_origins: tuple[str, ...] = ()  # CORS allow-list for browser frontends
    max_request_body_bytes: int = 4 << 20
    # Slow clients (service/guards/connections.py, service/guards/limits.py): a request's headers
    # must be complete this long after its first byte, and its body this long
    # after its headers, else 408 and the connection closed.
    header_timeout_seconds: float = 10.0
    body_timeout_seconds: float = 30.0
    # Open connections past this: an idle one is closed, or the new one gets 503.
    max_connections: int = 2048
    # Refusal pacing (service/guards/pacing.py): a client's 4xx answers past this burst
    # go out at this rate a second, up to a burst more wait, past that 429; 0 turns it off.
    refusal_rate: float = 20.0
    refusal_burst: int = 40
    # Peers (addresses, CIDR networks) whose X-Forwarded-For names the client: a
    # proxy that appends the address it saw. None by default: anyone can send the header.
    trusted_proxies: tuple[str, ...] = ()
    # Request preparation (service/serving/lanes.py): threads for chat templates and
    # tokenizing, and, apart, for grammar compiles (lowest CPU priority past 1 s).
    prep_threads: int = 4
    compile_threads: int = 2  # one running compile per tenant: 2 let a second tenant in
    # Back-pressure: past this many waiting requests new ones get 429.
    max_waiting_requests: int = 1024
    retry_after_seconds: int = 1
    # SIGTERM: stop admitting, let streams run this long, then abort the rest.
    shutdown_grace_seconds: float = 30.0
    sse_ping_seconds: float = 10.0  # keep-alive comments while a long prefill runs
    log_prompts: bool = False
    # Sampling defaults for requests that leave a setting out: "auto" takes the
    # model's generation_config.json (as vLLM does), "vllm" the API's own
    # (temperature 1.0, top_p 1.0, ...).
    generation_config: str = "auto"
    tool_call_parser: str = "auto"
    reasoning_parser: str | None = None  # None: a thought stays in the content, as in vLLM
    # LoRA adapters (service/serving/loras.py): those served from start-up, and
    # whether /v1/load_lora_adapter and /v1/unload_lora_adapter exist (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    lora_modules: tuple[LoRAModule, ...] = ()
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise ValueError("engine must be an EngineConfig")
        if not isinstance(self.fleet, FleetConfig):
            raise ValueError("fleet must be a FleetConfig")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        object.__setattr__(self, "admin_keys", tuple(self.admin_keys))
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        object.__setattr__(self, "trusted_proxies", tuple(map(_proxy, self.trusted_proxies)))
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        self._check_pooling()
        self._check_loras()
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config={self.generation_config!r} must be one of "
                             f"{', '.join(GENERATION_CONFIGS)}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r} must be one of "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser={self.reasoning_parser!r} must be one of "
                             f"{', '.join(REASONING_PARSERS)} (or None)")
        if any(not key for key in self.api_keys + self.admin_keys):
            raise ValueError("api_keys and admin_keys must not contain an empty key")
        floor = self.min_priority_non_admin
        if isinstance(floor, bool) or not isinstance(floor, int) or not (
                PRIORITY_MIN <= floor <= PRIORITY_MAX):
            raise ValueError(f"min_priority_non_admin={floor!r} must be an integer in "
                             f"[{PRIORITY_MIN}, {PRIORITY_MAX}]")
        for name in ("max_request_body_bytes", "max_waiting_requests", "retry_after_seconds",
                     "max_connections", "prep_threads", "compile_threads", "refusal_burst"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("header_timeout_seconds", "body_timeout_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}={value!r} must be > 0")
        for name in ("shutdown_grace_seconds", "sse_ping_seconds", "refusal_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name}={value!r} must be a number >= 0")

    def _check_pooling(self) -> None:
        """A pooling model (--runner pooling) generates nothing: settings that shape
        generation are refused rather than ignored."""
        if self.engine.runner != "pooling":
            return
        for flag, used in (("--reasoning-parser", self.reasoning_parser is not None),
                           ("--lora-modules", bool(self.lora_modules)),
                           ("--allow-runtime-lora-updating", self.allow_runtime_lora_updating)):
            if used:
                raise ValueError(f"{flag} shapes generation; a pooling model (--runner "
                                 "pooling) generates nothing")

    def _check_loras(self) -> None:
        """Adapters need an engine that serves them; names must not collide."""
        needs = [flag for flag, used in (("--lora-modules", self.lora_modules),
                                         ("--allow-runtime-lora-updating",
                                          self.allow_runtime_lora_updating)) if used]
        if needs and not self.engine.enable_lora:
            raise ValueError(f"{needs[0]} needs --enable-lora (enable_lora=True)")
        if not all(isinstance(module, LoRAModule) for module in self.lora_modules):
            raise ValueError("lora_modules must be LoRAModule items")
        served = self.served_model_name or self.engine.model
        names = [module.name for module in self.lora_modules]
        for module in self.lora_modules:
            if module.name == served:
                raise ValueError(f"LoRA module {module.name!r} has the served model's name")
            if names.count(module.name) > 1:
                raise ValueError(f"LoRA module {module.name!r} is given twice")
            if module.base_model_name not in (None, served):
                raise ValueError(f"LoRA module {module.name!r}: base_model_name "
                                 f"{module.base_model_name!r} is not the served model "
                                 f"{served!r}")
