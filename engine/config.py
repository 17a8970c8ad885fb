"""EngineConfig: every knob of the engine in one frozen, validated object.

The config is built once (from the CLI, the offline `LLM(...)` call or a test),
validated on construction and then passed explicitly to whatever needs it.
Nothing mutates it afterwards, so every component sees the same numbers.

`max_model_len` depends on the model: the engine resolves it once the model's
HF config is read (`resolve_max_model_len`), which returns a new, validated
EngineConfig with the model's limit filled in or refuses a value beyond it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.speculative_config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's --kv-cache-dtype names (fp8 is fp8_e4m3), and int8 (llama.cpp's q8_0 cache
# is the nearest): kernels/kv_quant.py holds the formats; engine/model/kv_cache.py
# resolves a name to the cache's torch dtype.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
# kernels.BACKEND_NAMES, restated so that building a config (and --help) imports
# no torch; tests/kernels/test_kernels_api.py holds the two equal.
KERNEL_BACKENDS = ("auto", "torch", "triton", "cpu")
SCHEDULING_POLICIES = ("fcfs", "priority")
# The quantizations of a float checkpoint at load (layers/quantization.py's list,
# restated: a config imports no torch; tests/engine/test_quantization.py holds them equal).
LOAD_QUANTIZATIONS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k")
QUANTIZATIONS = (None, "gguf", "none", *LOAD_QUANTIZATIONS)
# vLLM's names: "dummy" fills the weights at random from config.json alone (benchmarks).
LOAD_FORMATS = ("auto", "safetensors", "dummy")
KV_EVENTS_SCHEMES = ("tcp://", "ipc://", "inproc://")  # ZMQ transports a publisher can use
MAX_BLOCK_SIZE = 128
MAX_LORA_RANK = 64
RUNNERS = ("generate", "pooling")  # vLLM's --runner
CONVERTS = (None, "embed", "classify")  # vLLM's --convert, for a pooling runner
DEFAULT_MODEL = "smollm2-135m-instruct"
# Names of the default model, a GGUF file (engine/model/models/loader.py).
DEFAULT_MODEL_ALIASES = (DEFAULT_MODEL, "smollm2", "SmolLM2-135M-Instruct")


def default_cache_dir() -> Path:
    """Where converted models live: $XDG_CACHE_HOME/pagedserve (never in the repo)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedserve"


def is_gguf_model(model: str) -> bool:
    """Whether a model name names a GGUF file: the default model, or a .gguf path."""
    return model in DEFAULT_MODEL_ALIASES or str(model).endswith(".gguf")


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class EngineConfig:
    """Each field is also a command-line flag (engine/args.py makes `--block-size`
    from `block_size`), so its default and help are written here and only here.
    metadata: "help" for --help, "choices" for a closed set, "cli": False for a
    field that only the Python API sets."""

    model: str = field(default=DEFAULT_MODEL, metadata={
        "help": "a model name (see engine/model/models/loader.py), an HF folder or a .gguf file"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "tokenizer folder or name (default: the model's own)"})
    dtype: str = field(default="auto", metadata={
        "help": "weights and KV cache (unless --kv-cache-dtype int8); auto: the "
                "checkpoint's, bfloat16 for float32 checkpoints where bf16 matmuls are fast",
        "choices": DTYPES})
    quantization: str | None = field(default=None, metadata={
        "help": "gguf (the default for a .gguf model on one rank): its tensors in their own quant types; "
                "none: float weights (a GGUF de-quantized once, for HF parity); "
                f"{'|'.join(LOAD_QUANTIZATIONS)}: a float checkpoint quantized at load (CPU)",
        "choices": QUANTIZATIONS})
    load_format: str = field(default="auto", metadata={
        "help": "auto/safetensors: the checkpoint's weights; dummy: random weights from "
                "config.json alone, to benchmark a model's shape without its weights",
        "choices": LOAD_FORMATS})
    seed: int = field(default=0, metadata={
        "help": "seed of the sampler's draws for unseeded requests"})
    # Paged KV cache.
    block_size: int = field(default=16, metadata={
        "help": f"tokens per KV block: a power of two up to {MAX_BLOCK_SIZE}"})
    gpu_memory_utilization: float = field(default=0.90, metadata={
        "help": "CUDA: fraction of GPU memory for weights, activations and KV cache"})
    kv_cache_memory_bytes: int = field(default=1 << 30, metadata={
        "help": "CPU: KV cache budget in bytes"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "what the KV cache stores; auto: K/V in the serving dtype (--dtype); "
                "bfloat16, float32: that dtype, which must be the serving one; int8: each "
                "token's K and V per KV head as 8-bit codes and an fp16 scale: 1.94x the "
                "tokens of bfloat16 (3.9x of float32) in the same budget at head_dim 64, "
                "at a small cost in precision (greedy outputs may part from a float "
                "cache's after some tokens) and in attention time (each row read is "
                "de-quantized); fp8 (= fp8_e4m3), fp8_e5m2: each value in 8 bits, "
                "per-tensor scale 1.0 (vLLM's formats): the same tokens as int8, less precise",
        "choices": KV_CACHE_DTYPES})
    kv_cache_prefault: bool = field(default=True, metadata={
        "help": "CPU: back the KV cache's pages at start, so no request pays their faults; "
                "off: as its blocks are first written (a faster start; LLM's default offline)"})
    # Tests: exact KV block counts (main pool, hybrid sliding pool) to force preemption.
    num_gpu_blocks_override: int | None = field(default=None, metadata={"cli": False})
    num_window_blocks_override: int | None = field(default=None, metadata={"cli": False})
    disable_hybrid_kv_cache_manager: bool = field(default=False, metadata={
        "help": "give the sliding layers of a model that mixes sliding and global layers "
                "(Gemma 2/3) no KV pool of their own: every block stays held for every "
                "layer (the KV offload tiers imply it)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV blocks of shared prompt prefixes"})
    async_scheduling: bool = field(default=False, metadata={
        "help": "schedule and launch step N+1 before step N's tokens reach the host, so the "
                "host's work overlaps the device's; outputs as without it; steps that cannot "
                "overlap run as usual (engine/frontend/async_step.py; vLLM's flag)"})
    # Scheduler.
    max_num_seqs: int = field(default=256, metadata={
        "help": "most sequences in one step"})
    max_num_batched_tokens: int = field(default=8192, metadata={
        "help": "most tokens in one step (the chunked-prefill budget)"})
    scheduling_policy: str = field(default="fcfs", metadata={
        "help": "fcfs: first come, first served; priority: a request's `priority` first "
                "(lower values first, then arrival), and a preemption takes the lowest "
                "priority, as vLLM's --scheduling-policy",
        "choices": SCHEDULING_POLICIES})
    schedule_conservativeness: float = field(default=1.0, metadata={
        "help": "how many free KV blocks admission keeps for the running sequences' "
                "expected growth: 0 admits whenever a prompt fits (preempting more "
                "later), above 1 is more cautious"})
    max_model_len: int = field(default=0, metadata={
        "help": "longest sequence, prompt and output; 0: the model's own limit"})
    # Parallelism and kernels.
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "devices the model is split over (tensor parallelism: one process per "
                "rank, gloo on CPU, NCCL on CUDA); must divide the attention heads"})
    kernel_backend: str = field(default="auto", metadata={
        "help": "attention kernels; auto: Triton on CUDA, the compiled CPU op elsewhere "
                "(the torch paths where it can't build); torch: the pure-torch reference; "
                "cpu: the compiled CPU op or an error",
        "choices": KERNEL_BACKENDS})
    device: str = field(default="auto", metadata={
        "help": "auto, cpu or cuda[:N]; auto: cuda when available, else cpu"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "CUDA: run every step eagerly, without the decode steps' CUDA graphs "
                "(engine/model/cuda_graphs.py; vLLM's flag); the CPU always runs eager"})
    num_threads: int = field(default=0, metadata={
        "help": "CPU: torch threads for the model; 0: torch's default, one per core"})
    # KV cache events for a KV-cache-aware router (engine/core/kv_events.py).
    kv_events_endpoint: str | None = field(default=None, metadata={
        "help": "publish KV cache events (vLLM's schema, for a KV-cache-aware router: "
                "vllm-router, llm-d) on this ZMQ endpoint, which is bound as vLLM binds "
                "it: tcp://127.0.0.1:5557 listens on loopback, tcp://*:5557 on every "
                "interface, ipc:// on a socket file; routers connect; unset: no events"})
    kv_events_topic: str = field(default="", metadata={
        "help": "the topic frame of every KV event message (llm-d reads the pod and "
                "model names from it; vllm-router reads only the empty topic)"})
    kv_events_replay_endpoint: str | None = field(default=None, metadata={
        "help": "bind a ZMQ ROUTER socket here that replays the last "
                "--kv-events-buffer-steps event batches from a sequence number asked "
                "for (vLLM's replay_endpoint; vllm-router's --kv-event-replay-source), "
                "so a restarted router rebuilds its index; unset: no replay"})
    kv_events_buffer_steps: int = field(default=10_000, metadata={
        "help": "event batches kept for replay (vLLM's buffer_steps)"})
    # Offload tiers under the prefix cache (engine/core/kv_offload/).
    kv_offload_host_bytes: int = field(default=0, metadata={
        "help": "bytes of the host-memory KV tier (pinned on CUDA, a RAM pool on CPU); "
                "0: no host tier"})
    kv_offload_disk_dir: str | None = field(default=None, metadata={
        "help": "folder of the disk KV tier (a file per block, least recently used "
                "dropped first); unset: no disk tier"})
    kv_offload_disk_bytes: int = field(default=16 << 30, metadata={
        "help": "most bytes the disk KV tier keeps"})
    kv_offload_redis_url: str | None = field(default=None, metadata={
        "help": "Redis of the KV tier the fleet shares (redis:// or rediss://; give that "
                "Redis maxmemory and maxmemory-policy volatile-lru); unset: no Redis tier"})
    kv_offload_redis_ttl: int = field(default=3600, metadata={
        "help": "seconds a block lives in the Redis KV tier"})
    kv_offload_store_threshold: int = field(default=2, metadata={
        "help": "requests that must share a full prompt block before it is copied into "
                "the KV tiers"})
    # Speculative decoding without a draft model (engine/spec_decode/).
    speculative_config: SpeculativeConfig | None = field(default=None, metadata={
        "help": "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
                "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
                "\"prompt_lookup_min\": 2}' or '{\"method\": \"suffix\"}'; unset: none",
        "parse": SpeculativeConfig.parse})
    # LoRA adapters over the one base model (engine/model/lora/; vLLM's flags).
    enable_lora: bool = field(default=False, metadata={
        "help": "serve LoRA adapters (PEFT folders) beside the base model: a request "
                "names one (the service's `model`), and a step mixes rows of the base and "
                "of up to --max-loras adapters"})
    max_loras: int = field(default=1, metadata={
        "help": "most distinct adapters in one step (slots held in every adapted projection)"})
    max_lora_rank: int = field(default=16, metadata={
        "help": "the highest adapter rank served (adapters above it are refused); "
                f"up to {MAX_LORA_RANK}"})
    max_cpu_loras: int | None = field(default=None, metadata={
        "help": "adapters kept read in host memory, least recently used dropped first "
                "(read again from their folder when asked for); default: --max-loras"})
    # Pooling: prefill-only requests answered with a vector (engine/model/pooling/; vLLM's flags).
    runner: str = field(default="generate", metadata={
        "help": "generate: a model that writes text; pooling: embeddings, classification "
                "and scores (an encoder such as BERT, or a decoder's hidden states)",
        "choices": RUNNERS})
    convert: str | None = field(default=None, metadata={
        "help": "--runner pooling over a generator checkpoint: embed (the last token's hidden "
                "state) or classify (a sequence-classification head, `score`, from the "
                "checkpoint); default: what the checkpoint's architecture is", "choices": CONVERTS})
    # Converted models live here; $XDG_CACHE_HOME already moves it, so no flag.
    cache_dir: Path = field(default_factory=default_cache_dir, metadata={"cli": False})

    def __post_init__(self) -> None:
        self._check_ints()
        self._check_choices()
        self._check_kv_events()
        self._check_offload()
        self._check_lora()
        self._check_pooling()
        if not _is_power_of_two(self.block_size) or self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(
                f"block_size={self.block_size} is not supported: use a power of two "
                f"from 1 to {MAX_BLOCK_SIZE} (1, 2, 4, 8, 16, 32, 64, 128)"
            )
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be at "
                             f"least block_size={self.block_size}")
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)):
            raise ValueError(f"gpu_memory_utilization must be a number, got {utilization!r}")
        if not 0.0 < utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        conservativeness = self.schedule_conservativeness
        if isinstance(conservativeness, bool) or not isinstance(conservativeness, (int, float)) \
                or not conservativeness >= 0:
            raise ValueError(f"schedule_conservativeness must be a number >= 0, "
                             f"got {conservativeness!r}")
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        object.__setattr__(self, "quantization", self._resolved_quantization())
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.parse(self.speculative_config))

    def _resolved_quantization(self) -> str | None:
        """quantization with its default filled in: gguf for a GGUF model (none
        under tensor parallelism, which slices float weights only)."""
        gguf, quantization = is_gguf_model(self.model), self.quantization
        if quantization == "gguf" and not gguf:
            raise ValueError(f"quantization='gguf' serves a GGUF file's own tensors; "
                             f"model {self.model!r} is not a .gguf file")
        if quantization == "gguf" and self.tensor_parallel_size > 1:
            raise ValueError("quantization='gguf' runs on one rank: tensor parallelism slices "
                             "float weights (quantization='none')")
        if gguf and quantization is None and self.tensor_parallel_size > 1:
            return "none"
        if gguf and quantization not in (None, "gguf", "none"):
            raise ValueError(f"quantization={quantization!r} quantizes a float checkpoint; a .gguf "
                             "model is served in its own types (gguf) or de-quantized (none)")
        return "gguf" if gguf and quantization is None else quantization

    def _check_ints(self) -> None:
        minimums = {
            "block_size": 1,
            "max_num_seqs": 1,
            "max_num_batched_tokens": 1,
            "max_model_len": 0,
            "tensor_parallel_size": 1,
            "kv_cache_memory_bytes": 1,
            "seed": 0,
            "num_threads": 0,
            "kv_events_buffer_steps": 1,
            "kv_offload_host_bytes": 0,
            "kv_offload_disk_bytes": 1,
            "kv_offload_redis_ttl": 1,
            "kv_offload_store_threshold": 1,
        }
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value < minimum:
                raise ValueError(f"{name}={value} must be >= {minimum}")
        blocks = self.num_gpu_blocks_override
        if blocks is not None and (not isinstance(blocks, int) or blocks < 2):
            raise ValueError(f"num_gpu_blocks_override={blocks!r} must be an integer >= 2")

    def _check_choices(self) -> None:
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported: choose one of {DTYPES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported: "
                             f"choose one of {KV_CACHE_DTYPES}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization={self.quantization!r} is not supported: choose one of {QUANTIZATIONS}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format={self.load_format!r} is not supported: choose one of {LOAD_FORMATS}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(
                f"kernel_backend={self.kernel_backend!r} is not supported: "
                f"choose one of {KERNEL_BACKENDS}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} is not supported: "
                             f"choose one of {SCHEDULING_POLICIES}")
        device = self.device
        if not isinstance(device, str) or not (
            device in ("auto", "cpu") or device.startswith("cuda")
        ):
            raise ValueError(f"device={self.device!r} must be 'auto', 'cpu' or 'cuda[:N]'")

    def _check_kv_events(self) -> None:
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and not (
                isinstance(endpoint, str) and endpoint.startswith(KV_EVENTS_SCHEMES)
            ):
                raise ValueError(f"{name}={endpoint!r} must start with "
                                 f"{', '.join(KV_EVENTS_SCHEMES)}")
        replay = self.kv_events_replay_endpoint
        if replay is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint: it "
                             "replays the events published there")
        if replay is not None and replay == self.kv_events_endpoint:
            raise ValueError(f"kv_events_replay_endpoint={replay!r} must differ from "
                             "kv_events_endpoint: each is a socket of its own")
        if not isinstance(self.kv_events_topic, str):
            raise ValueError(f"kv_events_topic must be a string, got {self.kv_events_topic!r}")

    @property
    def kv_offload_enabled(self) -> bool:
        """Some offload tier is configured."""
        return bool(self.kv_offload_host_bytes or self.kv_offload_disk_dir
                    or self.kv_offload_redis_url)

    @property
    def hybrid_kv_cache(self) -> bool:
        """The sliding layers of a hybrid model get their own KV pool: unless
        disabled, or the offload tiers are on (they move one pool's blocks)."""
        return not (self.disable_hybrid_kv_cache_manager or self.kv_offload_enabled)

    def _check_offload(self) -> None:
        url = self.kv_offload_redis_url
        if url is not None and not (isinstance(url, str)
                                    and url.startswith(("redis://", "rediss://", "unix://"))):
            raise ValueError(f"kv_offload_redis_url={url!r} must start with redis://, "
                             f"rediss:// or unix://")
        if self.kv_offload_enabled and not self.enable_prefix_caching:
            raise ValueError("the KV offload tiers sit under the prefix cache: they need "
                             "enable_prefix_caching")

    def _check_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} is above {MAX_LORA_RANK}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= "
                             f"max_loras={self.max_loras}: a step reads its adapters from there")

    def _check_pooling(self) -> None:
        if self.runner not in RUNNERS or self.convert not in CONVERTS:
            raise ValueError(f"runner={self.runner!r} / convert={self.convert!r}: choose runner "
                             f"from {RUNNERS} and convert from {CONVERTS[1:]}")
        if self.runner != "pooling":
            if self.convert is not None:
                raise ValueError(f"convert={self.convert!r} needs runner='pooling'")
            return
        clashes = [name for name, on in (
            ("enable_lora", self.enable_lora), ("speculative_config", self.speculative_config),
            ("tensor_parallel_size > 1", self.tensor_parallel_size > 1)) if on]
        if clashes:
            raise ValueError(f"runner='pooling' does not run with {', '.join(clashes)}")

    def replace(self, **changes) -> "EngineConfig":
        """A new validated config with some fields changed (the original stays as it was)."""
        return dataclasses.replace(self, **changes)

    def resolve_max_model_len(self, model_limit: int) -> "EngineConfig":
        """Fill in max_model_len from the model's own limit, refusing values beyond it."""
        if self.max_model_len > model_limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's limit "
                f"(max_position_embeddings={model_limit})"
            )
        return self.replace(max_model_len=self.max_model_len or model_limit)
