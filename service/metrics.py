"""Prometheus metrics, named as vLLM names them but with our prefix.

Two sources feed one registry (per app, so two servers in one process never mix):

- engine state (queues, KV blocks, cache hits, token counters) is read at
  scrape time from the engine thread's latest stats snapshot, so the engine
  pays nothing per step for metrics;
- latencies (TTFT, inter-token, end-to-end) are observed on the asyncio side,
  where a token actually leaves for the client;
- outcomes are counted there too: each finished request (each choice of one)
  by its reason, `pagedserve:request_success_total{finished_reason}` as vLLM's
  (stop, length, abort, error), and every error answer by status and code,
  `pagedserve:http_errors_total{status="400",code="unknown_parameter"}` (code
  "" when the error has none), once, as it is sent (a refusal that pacing
  answers 429 in its place counts as the 429), and the error answers that
  refusal pacing held back, `pagedserve:refusals_paced_total`.

`pagedserve:kv_cache_usage_perc` is a fraction in [0, 1], as vLLM's is.
Cached blocks that no request holds count as free: they are evictable.

The KV cache's configuration, fixed at start-up, is an info gauge as vLLM's
`vllm:cache_config_info` (value 1, the settings in its labels):
`pagedserve:cache_config_info{cache_dtype="int8",block_size="16",num_gpu_blocks="2049"}`
(num_gpu_blocks is vLLM's name: the blocks of the device pool, CPU memory
included), with the tokens they hold beside it, `pagedserve:kv_cache_capacity_tokens`.
With --enable-lora, `pagedserve:lora_adapters_loaded` counts the adapters
served by name (service/serving/loras.py).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.frontend.async_engine import AsyncEngine
from engine.model.kv_cache import token_capacity

PREFIX = "pagedserve:"

# Seconds. CPU serving is slow and GPU serving fast; the buckets cover both.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
STEP_BUCKETS = tuple(round(0.001 * 1.25**i, 6) for i in range(45))  # 1 ms .. ~23 s, 25 % apart
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
# Why a request ended: the engine's reasons, "abort" when the client left (or it
# was cancelled) first, "error" when the engine failed or the server ended it.
FINISHED_REASONS = ("stop", "length", "abort", "error")

# (metric, help, stats key) for engine state, read at scrape time.
GAUGES = (
    ("num_requests_running", "Requests in the running batch.", "num_requests_running"),
    ("num_requests_waiting", "Requests waiting to be scheduled.", "num_requests_waiting"),
    ("kv_blocks_free", "KV blocks no request holds (cached ones included).", "kv_blocks_free"),
    ("kv_blocks_total", "KV blocks usable for sequences.", "kv_blocks_total"),
    ("prefix_warm_blocks", "Cached KV blocks of the fleet's popular prefixes (warmed or "
     "marked popular).", "prefix_warm_blocks"),
)
COUNTERS = (
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("num_preemptions", "Sequences preempted to free KV blocks.", "num_preemptions"),
    ("prompt_tokens", "Prompt tokens of all requests.", "prompt_tokens"),
    ("generation_tokens", "Tokens generated.", "generation_tokens"),
)


# (metric, help, key of LLMEngine.memory_per_rank()), labelled by tensor-parallel rank.
MEMORY_GAUGES = (
    ("model_weights_bytes", "Bytes of model weights the rank holds (its slice under tensor "
     "parallelism).", "weights_bytes"),
    ("kv_cache_bytes", "Bytes of KV cache the rank holds (its KV heads' share).",
     "kv_cache_bytes"),
)


class EngineCollector:
    """Reports the engine's latest stats snapshot whenever Prometheus scrapes."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.memory = engine.engine.memory_per_rank()  # fixed once the model is loaded
        self.by_priority = engine.engine.config.scheduling_policy == "priority"

    def cache_config(self):
        """The KV cache's settings (cache_config_info) and its token capacity."""
        blocks, block_size = self.engine.engine.runner.num_blocks, self.engine.config.block_size
        info = GaugeMetricFamily(
            PREFIX + "cache_config_info", "The KV cache's configuration (value 1): the "
            "dtype it stores, tokens per block, blocks of the device pool.",
            labels=["cache_dtype", "block_size", "num_gpu_blocks"])
        info.add_metric([self.engine.kv_cache_dtype, str(block_size), str(blocks)], 1)
        yield info
        yield GaugeMetricFamily(PREFIX + "kv_cache_capacity_tokens", "Tokens the KV cache "
                                "holds: its usable blocks (all but the null block) times "
                                "block_size.", value=token_capacity(blocks, block_size))

    def collect(self):
        yield from self.cache_config()
        for name, help_text, key in MEMORY_GAUGES:
            family = GaugeMetricFamily(PREFIX + name, help_text, labels=["rank"])
            for rank, memory in enumerate(self.memory):
                family.add_metric([str(rank)], memory[key])
            yield family
        stats = self.engine.stats.counters
        for name, help_text, key in GAUGES:
            yield GaugeMetricFamily(PREFIX + name, help_text, value=stats[key])
        total = stats["kv_blocks_total"]
        usage = 1.0 - stats["kv_blocks_free"] / total if total else 0.0
        yield GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc", "Fraction of KV blocks held by requests.", value=usage
        )
        for name, help_text, key in COUNTERS:
            yield CounterMetricFamily(PREFIX + name, help_text, value=stats[key])
        if "spec_decode_num_drafts" in stats:
            yield from spec_decode_families(stats)
        if self.by_priority:
            yield priority_family(stats)


# Speculative decoding, with --speculative-config only (vLLM's names).
SPEC_COUNTERS = (
    ("spec_decode_num_drafts", "Drafts verified (one per sequence and step that drafted)."),
    ("spec_decode_num_draft_tokens", "Draft tokens verified."),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
)
PER_POSITION = "spec_decode_num_accepted_tokens_pos_"


def priority_family(stats: dict) -> GaugeMetricFamily:
    """--scheduling-policy priority: requests running and waiting per priority value
    (a value with none of either is left out)."""
    family = GaugeMetricFamily(PREFIX + "num_requests_by_priority",
                               "Requests running or waiting, by state and priority.",
                               labels=["state", "priority"])
    for key, value in stats.items():
        for state in ("running", "waiting"):
            prefix = f"num_requests_{state}_priority_"
            if key.startswith(prefix):
                family.add_metric([state, key.removeprefix(prefix)], value)
    return family


def spec_decode_families(stats: dict):
    for name, help_text in SPEC_COUNTERS:
        yield CounterMetricFamily(PREFIX + name, help_text, value=stats[name])
    family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                 "Draft tokens accepted, by position in the draft.",
                                 labels=["position"])
    for key, value in stats.items():
        if key.startswith(PER_POSITION):
            family.add_metric([key.removeprefix(PER_POSITION)], value)
    yield family


# (metric, help, key of a tier's snapshot) for each KV offload tier, labelled by tier.
TIER_COUNTERS = (
    ("kv_offload_hits", "KV blocks loaded from the tier (sound records).", "hits"),
    ("kv_offload_misses", "Loads from the tier that found nothing or a bad record.", "misses"),
    ("kv_offload_bad_records", "Records of the tier that failed their checks (corrupt, "
     "truncated, foreign): each was a miss.", "bad_records"),
    ("kv_offload_stores", "KV blocks written to the tier.", "stores"),
    ("kv_offload_loaded_bytes", "Bytes loaded from the tier.", "bytes_loaded"),
    ("kv_offload_stored_bytes", "Bytes written to the tier.", "bytes_stored"),
    ("kv_offload_evictions", "Blocks the tier dropped to stay within its bound.", "evictions"),
    ("kv_offload_errors", "Failed operations of the tier's medium (I/O, connection).",
     "errors"),
)
TIER_GAUGES = (
    ("kv_offload_usage_bytes", "Bytes the tier holds (Redis: the server's used_memory).",
     "used_bytes"),
    ("kv_offload_capacity_bytes", "The tier's bound in bytes (Redis: maxmemory, 0 if none).",
     "capacity_bytes"),
    ("kv_offload_tier_up", "1 while the tier serves, 0 when it is disabled or unreachable.",
     "up"),
)
# (metric, help, key) of the offload manager, over all tiers.
OFFLOAD_COUNTERS = (
    ("kv_offload_loads", "Load jobs started at admission.", "loads"),
    ("kv_offload_blocks_loaded", "KV blocks that load jobs brought into the device cache.",
     "blocks_loaded"),
    ("kv_offload_blocks_load_failed", "KV blocks a load job could not bring (then computed).",
     "blocks_load_failed"),
    ("kv_offload_blocks_stored", "KV blocks copied out of the device for the tiers.",
     "blocks_stored"),
    ("kv_offload_stores_dropped", "KV blocks not stored because the store thread was behind.",
     "stores_dropped"),
)


class OffloadCollector:
    """The KV offload tiers (only when the engine has some)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.stats.offload
        if not stats:
            return
        tiers = stats["tiers"]
        for kind, table in ((CounterMetricFamily, TIER_COUNTERS), (GaugeMetricFamily, TIER_GAUGES)):
            for name, help_text, key in table:
                family = kind(PREFIX + name, help_text, labels=["tier"])
                for tier, values in tiers.items():
                    family.add_metric([tier], values[key])
                yield family
        for name, help_text, key in OFFLOAD_COUNTERS:
            yield CounterMetricFamily(PREFIX + name, help_text, value=stats[key])


class FleetCollector:
    """The replica's link to the fleet's Redis (only with --redis-url)."""

    def __init__(self, fleet) -> None:
        self.fleet = fleet

    def collect(self):
        registry = self.fleet.registry
        yield GaugeMetricFamily(PREFIX + "redis_up", "1 while the fleet's Redis answers, "
                                "else 0.", value=int(registry.redis_up))
        yield GaugeMetricFamily(PREFIX + "prefix_warming", "1 until the start-up warm-up "
                                "is done.", value=int(self.fleet.warming))
        yield CounterMetricFamily(PREFIX + "registry_sightings_recorded", "System-prompt "
                                  "sightings written to the registry.", value=registry.recorded)
        yield CounterMetricFamily(PREFIX + "registry_sightings_dropped", "Sightings lost to a "
                                  "full buffer while Redis was slow or down.",
                                  value=registry.dropped)


class LoRACollector:
    """The LoRA adapters served by name (--lora-modules and run-time loads)."""

    def __init__(self, loras) -> None:
        self.loras = loras  # service/serving/loras.py LoRARegistry

    def collect(self):
        yield GaugeMetricFamily(PREFIX + "lora_adapters_loaded", "LoRA adapters registered "
                                "(requests may name them as `model`).",
                                value=len(self.loras.adapters))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from arrival to the first token.",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between two tokens of a request.",
            buckets=ITL_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
            buckets=E2E_BUCKETS, registry=self.registry,
        )

        # Not in vLLM's set: the engine's own step time, so a benchmark can tell
        # how much of the inter-token latency the HTTP/SSE/thread hop adds.
        self.engine_step = Histogram(
            PREFIX + "engine_step_seconds", "Wall time of one engine step (schedule, "
            "forward, sample, detokenize).", buckets=STEP_BUCKETS, registry=self.registry,
        )

        self.finished = Counter(
            PREFIX + "request_success", "Finished requests (each choice), by why they "
            "ended: stop, length, abort (the client left first), error.",
            ["finished_reason"], registry=self.registry,
        )
        for reason in FINISHED_REASONS:
            self.finished.labels(reason)  # each reason shown from the start, at 0
        self.http_errors = Counter(
            PREFIX + "http_errors", "Error answers, by HTTP status and error code (\"\" "
            "when it has none); an error inside a started stream is a finished \"error\".",
            ["status", "code"], registry=self.registry,
        )

        self.refusals_paced = Counter(
            PREFIX + "refusals_paced", "Error answers held back because their client had "
            "used its burst of refusals (service/guards/pacing.py).", registry=self.registry,
        )

    def count_error(self, status: int, code: str | int | None) -> None:
        self.http_errors.labels(str(status), "" if code is None else str(code)).inc()

    def watch(self, engine: AsyncEngine) -> None:
        """Report this engine's state at every scrape."""
        self.registry.register(EngineCollector(engine))
        self.registry.register(OffloadCollector(engine))

    def watch_loras(self, loras) -> None:
        """Report the served adapters at every scrape (an engine with enable_lora)."""
        self.registry.register(LoRACollector(loras))

    def watch_fleet(self, fleet) -> None:
        """Report the fleet link's state at every scrape."""
        self.registry.register(FleetCollector(fleet))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> "RequestTimer":
        return RequestTimer(self)


class RequestTimer:
    """Latency bookkeeping of one request, fed each time it receives tokens."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.last_token: float | None = None

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.perf_counter()
        if self.last_token is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            # Several tokens in one delivery (a slow consumer) share the gap.
            gap = (now - self.last_token) / count
            for _ in range(count):
                self.metrics.itl.observe(gap)
        self.last_token = now

    def finished(self) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)

    def ended(self, reason: str, count: int = 1) -> None:
        """`count` choices of the request ended, for `reason`."""
        if count > 0:
            self.metrics.finished.labels(reason).inc(count)
