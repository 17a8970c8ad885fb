"""Measuring helpers shared by the offline benchmarks: peak memory, the machine,
the matmul rate of this CPU/GPU, and the FLOPs a workload needs.

    with PeakMemory(device) as mem:     # CPU: process RSS sampled every 20 ms
        ...                             # CUDA: torch.cuda.max_memory_allocated
    mem.peak_bytes                      # peak above the RSS/allocation at entry

    rate = matmul_rate(hf_config, dtype, device)    # GFLOP/s on the model's linears
    flops = workload_flops(hf_config, prompt_lens, output_lens)
    floor_seconds = flops["total"] / (rate["best_gflops"] * 1e9)

FLOPs of a request with P prompt and O output tokens (a multiply-add is 2 FLOPs):

    L = P + O - 1                 tokens fed through the model (the last sampled
                                  token is never fed back)
    linear    = 2 * N_layers_linear * L       N: q, k, v, o, gate, up, down weights
    lm_head   = 2 * hidden * vocab * O        logits only where a token is sampled
    attention = 4 * layers * heads * head_dim * sum_{p=1..L} p
              = 4 * layers * heads * head_dim * L (L + 1) / 2
                                  QK^T and PV, 2 FLOPs each per query-key pair per
                                  head dimension; token p attends to p tokens (causal)

Embedding lookups, norms, RoPE, activations and sampling are left out: they are
memory traffic, not FLOPs worth counting. The floor divides the total by the
best rate measured on the model's own linear shapes, so it is a lower bound no
system on this machine can beat with these kernels' peak.
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import threading
import time

import torch
import torch.nn.functional as F

import kernels

FLOP_FORMULA = (
    "per request, L = prompt + output - 1 tokens fed: "
    "2 * layer_linear_params * L + 2 * hidden * vocab * output "
    "+ 4 * layers * heads * head_dim * L * (L + 1) / 2; "
    "floor_seconds = total_flops / measured matmul rate"
)

try:
    import psutil
except ImportError:  # not a dependency: fall back to /proc/self/statm
    psutil = None


# -- memory --------------------------------------------------------------------------
def current_rss() -> int:
    if psutil is not None:
        return psutil.Process().memory_info().rss
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so the next
    measurement starts from a baseline that does not hide reused memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the baseline is a bit higher, the peak a bit lower


class PeakMemory:
    """Peak memory above the level at entry.

    CPU: the process RSS, sampled from a background thread every `interval_s`
    (torch kernels release the GIL, so the thread runs during a long matmul).
    CUDA: torch.cuda.max_memory_allocated after a reset, minus the allocation
    at entry.
    """

    def __init__(self, device: torch.device | str = "cpu", interval_s: float = 0.02) -> None:
        self.device = torch.device(device)
        self.interval_s = interval_s
        self.start_bytes = 0
        self.peak_bytes = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._max_rss = 0

    def __enter__(self) -> "PeakMemory":
        release_memory()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
            self.method = "torch.cuda.max_memory_allocated"
            return self
        self.start_bytes = self._max_rss = current_rss()
        self.method = f"process RSS ({'psutil' if psutil else '/proc/self/statm'}) every " \
                      f"{self.interval_s * 1000:.0f} ms"
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._max_rss = max(self._max_rss, current_rss())

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self.start_bytes
            return
        self._stop.set()
        self._thread.join()
        self._max_rss = max(self._max_rss, current_rss())
        self.peak_bytes = self._max_rss - self.start_bytes

    def as_dict(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "start_bytes": self.start_bytes,
                "method": self.method}


# -- the machine ----------------------------------------------------------------------
def machine_info(device: torch.device) -> dict:
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or _cpu_model(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch_parallel_info": torch.__config__.parallel_info(),
        "device": str(device),
        "memory_measured_by": "torch.cuda.max_memory_allocated" if device.type == "cuda"
        else ("psutil RSS" if psutil else "/proc/self/statm RSS"),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# -- FLOPs -----------------------------------------------------------------------------
def model_shapes(hf_config) -> dict:
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    # (in_features, out_features) of each linear in one decoder layer
    linears = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    return {
        "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
        "layers": hf_config.num_hidden_layers, "vocab": hf_config.vocab_size,
        "linears": linears,
        "layer_linear_params": sum(i * o for i, o in linears.values()),
    }


def workload_flops(hf_config, prompt_lens: list[int], output_lens: list[int]) -> dict:
    """FLOPs of the workload (the formula in the module docstring)."""
    s = model_shapes(hf_config)
    linear_params = s["layer_linear_params"] * s["layers"]
    fed = [p + o - 1 for p, o in zip(prompt_lens, output_lens)]
    tokens_fed = sum(fed)
    linear = 2 * linear_params * tokens_fed
    lm_head = 2 * s["hidden"] * s["vocab"] * sum(output_lens)
    attention = 4 * s["layers"] * s["heads"] * s["head_dim"] * sum(n * (n + 1) // 2 for n in fed)
    return {
        "formula": FLOP_FORMULA,
        "linear_params": linear_params,
        "lm_head_params": s["hidden"] * s["vocab"],
        "tokens_fed": tokens_fed,
        "linear": linear,
        "lm_head": lm_head,
        "attention": attention,
        "total": linear + lm_head + attention,
    }


@torch.inference_mode()
def matmul_rate(hf_config, dtype: torch.dtype, device: torch.device,
                token_counts=(64, 256, 1024), repeats: int = 5, min_seconds: float = 0.05) -> dict:
    """GFLOP/s of the best matmul over one decoder layer's linear shapes,
    `token_counts` rows: F.linear, or the kernels' linear where it differs (the
    compiled bf16-weight op on the CPU), over nn.Linear's layout and over the
    layout the engine loads its weights in (``kernels.pack_linear``).

    Each repeat times enough passes over the 7 linears to last `min_seconds`;
    the best repeat counts. The best rate over the token counts and matmuls is
    the one the floor uses (a floor must not be beatable).
    """
    s = model_shapes(hf_config)
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(o, i, generator=gen) * i ** -0.5).to(device=device, dtype=dtype)
               for i, o in s["linears"].values()]
    # (matmul, [(in_features, weight)]): the engine multiplies its weights packed.
    plain = [(w.shape[1], w) for w in weights]
    matmuls = [(F.linear, plain), (kernels.linear, plain),
               (kernels.linear, [(width, kernels.pack_linear(w)) for width, w in plain])]
    per_tokens = {}
    for tokens in token_counts:
        inputs = {i: torch.randn(tokens, i, generator=gen).to(device=device, dtype=dtype)
                  for i, _ in s["linears"].values()}
        flops = 2 * tokens * s["layer_linear_params"]

        best = min(_best_pass_seconds(matmul, layer, inputs, device, repeats, min_seconds)
                   for matmul, layer in matmuls)
        per_tokens[tokens] = flops / best / 1e9
    best_tokens = max(per_tokens, key=per_tokens.get)
    return {
        "what": "F.linear or kernels.linear over nn.Linear's or the packed layout (the fastest) "
                "on one decoder layer's q,k,v,o,gate,up,down shapes; best of "
                f"{repeats} repeats, each >= {min_seconds} s",
        "dtype": str(dtype),
        "shapes_in_out": {k: list(v) for k, v in s["linears"].items()},
        "gflops_per_token_count": {str(k): v for k, v in per_tokens.items()},
        "best_token_count": best_tokens,
        "best_gflops": per_tokens[best_tokens],
    }


def _best_pass_seconds(matmul, layer, inputs, device, repeats: int, min_seconds: float) -> float:
    def one_pass():
        for in_features, weight in layer:
            matmul(inputs[in_features], weight)

    one_pass()  # warm-up (and oneDNN primitive creation)
    _sync(device)
    t0 = time.perf_counter()
    one_pass()
    _sync(device)
    iters = max(1, int(min_seconds / max(time.perf_counter() - t0, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            one_pass()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
