"""The two systems the embeddings benchmark times, and how it times them.

    texts = sized_texts(tokenizer, 256, (8, 256), seed=0)   # each about n tokens long
    ours, st = Pagedserve(folder, "float32", threads), SentenceTransformers(folder, "float32", 32)
    result = compare([ours, st], texts, query, rounds=3, repeats=30)   # [ours, st, vllm]: three

Both systems run in this process, on the same torch threads. They alternate
(A B A B ...; A B C with vLLM's worker, bench/offline/vllm_system.py), so a burst
of other work on the machine lands on each: each
throughput round is one call with every text (the engine batches them itself;
sentence-transformers encodes them in batches of `batch_size`, sorted by length
as it always does), and each latency repeat embeds the one query. A pair is A's
measurement and the B right after it; ratios are taken per pair, and their
median is the figure reported. Only the call is timed: turning outputs into
tensors happens after the clock stops.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import torch

from bench.common.report import percentile


def sized_texts(tokenizer, count: int, length: tuple[int, int], seed: int,
                words: list[str]) -> list[str]:
    """`count` texts of random words, each cut to a random length in `length`
    tokens of this tokenizer (special tokens not counted)."""
    rng = random.Random(seed)
    return [sized_text(tokenizer, rng, rng.randint(*length), words) for _ in range(count)]


def sized_text(tokenizer, rng: random.Random, tokens: int, words: list[str]) -> str:
    """Random words, cut at the end of the `tokens`-th token (so re-tokenizing
    gives that many, give or take a merge at the cut)."""
    text = " ".join(rng.choice(words) for _ in range(tokens + 8))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                        verbose=False)  # longer than the model takes: it is cut next
    offsets = encoded["offset_mapping"]
    return text[:offsets[min(tokens, len(offsets)) - 1][1]]


class Pagedserve:
    """This engine's offline LLM, runner "pooling". Prefix caching is off: the
    benchmark feeds the same texts every round, and a decoder embedder would
    otherwise answer later rounds from cached blocks that sentence-transformers
    has to compute."""

    name = "pagedserve"

    def __init__(self, folder: Path, dtype: str, threads: int, max_model_len: int = 0) -> None:
        from engine import LLM

        self.llm = LLM(str(folder), runner="pooling", dtype=dtype, num_threads=threads,
                       enable_prefix_caching=False, max_model_len=max_model_len)

    def embed(self, texts: list[str]):
        return self.llm.embed(texts, use_tqdm=False)

    @staticmethod
    def vectors(outputs) -> torch.Tensor:
        return torch.tensor([o.outputs.embedding for o in outputs], dtype=torch.float32)

    def num_tokens(self, texts: list[str]) -> int:
        return sum(len(o.prompt_token_ids) for o in self.embed(texts))


class SentenceTransformers:
    """`SentenceTransformer.encode(texts, batch_size=...)` at the model's dtype."""

    name = "sentence-transformers"

    def __init__(self, folder: Path, dtype: str, batch_size: int) -> None:
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(folder), device="cpu",
                                         model_kwargs={"dtype": getattr(torch, dtype)})
        self.batch_size = batch_size

    def embed(self, texts: list[str]):
        return self.model.encode(texts, batch_size=self.batch_size, convert_to_numpy=False,
                                 convert_to_tensor=True)

    @staticmethod
    def vectors(outputs) -> torch.Tensor:
        return outputs.to(torch.float32)


def timed(system, texts: list[str]) -> float:
    """Seconds of one `embed` call (a system in another process times itself)."""
    if hasattr(system, "timed"):
        return system.timed(texts)
    start = time.perf_counter()
    system.embed(texts)
    return time.perf_counter() - start


def cosines(a: torch.Tensor, b: torch.Tensor) -> dict:
    cosine = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
    return {"min_cosine": float(cosine.min()), "mean_cosine": float(cosine.mean())}


def compare(systems, texts: list[str], query: str, rounds: int, repeats: int,
            bar=None) -> dict:
    """Warm up ours and the baseline (systems[0], systems[1]) and check their
    vectors agree, then throughput rounds and latency repeats, every system in
    turn. A third system (vLLM) has warmed up and saved its vectors already.

    Each warms up on the batch twice: a process's heap reaches its steady
    size only then (ours, BERT-base's 128 texts: ~90,000 page faults in the
    first call, ~20,000 in the second, none after; the second call took
    1.07x the third), and a first round that still grows it is not the rate
    a busy server runs at."""
    ours, base = systems[0], systems[1]
    baseline = base.vectors(base.embed(texts))
    check = cosines(ours.vectors(ours.embed(texts)), baseline)
    for system in systems[:2]:
        system.embed(texts)
        for _ in range(3):
            system.embed([query])
    seconds = {s.name: [] for s in systems}
    latency = {s.name: [] for s in systems}
    for batch, measured, times in ((texts, seconds, rounds), ([query], latency, repeats)):
        for _ in range(times):
            for system in systems:
                measured[system.name].append(timed(system, batch))
                if bar is not None:
                    bar.update(1)
    result = summarize(ours.name, base.name, len(texts), seconds, latency)
    result.update(check, systems=[s.name for s in systems], vectors=baseline)
    for other in systems[2:]:
        result[other.name] = dict(summarize(ours.name, other.name, len(texts), seconds, latency),
                                  baseline=summarize(other.name, base.name, len(texts),
                                                     seconds, latency),
                                  **cosines(other.saved_vectors, baseline))
    return result


def summarize(ours: str, other: str, count: int, seconds: dict, latency: dict) -> dict:
    """`ours` against `other`: each one's rates and latencies, and the ratios of
    each round's and each repeat's pair (ours first)."""
    rates = {name: [count / s for s in seconds[name]] for name in (ours, other)}
    rate_ratios = [a / b for a, b in zip(rates[ours], rates[other])]
    latency_ratios = [a / b for a, b in zip(latency[ours], latency[other])]
    return {
        "throughput": {name: {"embeddings_per_s": statistics.median(values),
                              "rounds": values} for name, values in rates.items()},
        "throughput_ratios": rate_ratios,
        "throughput_ratio": statistics.median(rate_ratios),
        "latency": {name: {"p50_ms": percentile(latency[name], 50) * 1e3,
                           "p90_ms": percentile(latency[name], 90) * 1e3,
                           "ms": [v * 1e3 for v in latency[name]]} for name in (ours, other)},
        "latency_ratios": latency_ratios,
        "latency_ratio": statistics.median(latency_ratios),
        "p50_ratio": percentile(latency[ours], 50) / percentile(latency[other], 50),
    }


def profile_embed(system: Pagedserve, texts: list[str], top: int = 15) -> dict:
    """torch.profiler over one `embed` call: the ops that take the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = timed(system, texts)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    # Wall time the ops do not cover is Python: scheduling, tokenizing, outputs.
    return {"wall_ms": wall * 1e3, "ops_ms": total / 1e3,
            "top": [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3, "calls": e.count,
                     "share_of_wall": e.self_cpu_time_total / 1e6 / wall}
                    for e in events[:top]]}
