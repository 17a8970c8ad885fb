"""The two systems `bench throughput` compares, each run on one workload.

pagedserve: a fresh engine, stepped by bench/offline/driver.py so that the KV cache
can be sampled between steps (not timed); the KV utilisation it reports is
time-weighted over those samples.

HF `generate`: a fresh model per configuration; requests go in batches of a
fixed size, length-sorted by (output, prompt) length or in arrival order,
left-padded as decoder-only generation needs; each batch generates until its
longest request is done (only the requested tokens count).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench.common.measure import PeakMemory, release_memory
from bench.common.workload import Workload
from bench.offline.driver import Step, drive, warm_up
from engine.frontend.llm_engine import LLMEngine

KV_DEFINITION = ("time-weighted mean over steps of tokens whose K/V are held by running "
                 "sequences / slots: paged = blocks in their tables x block_size, "
                 "contiguous = running sequences x max_model_len")


@dataclass
class Result:
    """One system's run of a workload (pagedserve or one HF configuration)."""

    system: str
    config: str
    seconds: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    peak_memory_bytes: int
    fraction_of_floor: float = 0.0
    extra: dict = field(default_factory=dict)


def make_result(system, config, seconds, workload: Workload, peak, extra) -> Result:
    out = workload.num_output_tokens
    total = out + workload.num_prompt_tokens
    return Result(system, config, seconds, out / seconds, total / seconds,
                  workload.num_requests / seconds, peak, extra=extra)


# -- pagedserve ---------------------------------------------------------------------------
def run_pagedserve(config, workload: Workload, device) -> Result:
    with PeakMemory(device) as mem:
        engine = LLMEngine(config)
        warm = workload.prompts[:2]
        warm_up(engine, Workload("warm-up", warm, [4] * len(warm)))
        before = engine.stats()
        run = drive(engine, workload, f"pagedserve {workload.name}")
        after = engine.stats()
    config = engine.config
    num_blocks = engine.block_manager.num_usable_blocks
    kv_bytes = engine.runner.num_blocks * engine.runner.bytes_per_block()
    del engine
    release_memory()
    settings = (f"block_size={config.block_size}, max_num_seqs={config.max_num_seqs}, "
                f"max_num_batched_tokens={config.max_num_batched_tokens}, "
                f"kernels={config.kernel_backend}")
    kv = kv_utilization(run.steps, config.max_model_len)
    kv.update(kv_capacity(kv, num_blocks, config.block_size, config.max_model_len))
    extra = {
        "steps": len(run.steps),
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "prefix_cache_hits": after["prefix_cache_hits"] - before["prefix_cache_hits"],
        "kv_cache_bytes": kv_bytes,
        "kv_blocks": num_blocks,
        "block_size": config.block_size,
        "max_model_len": config.max_model_len,
        "memory": mem.as_dict(),
        "kv_utilization": kv,
    }
    return make_result("pagedserve", settings, run.engine_seconds, workload, mem.peak_bytes,
                       extra)


def kv_utilization(steps: list[Step], max_model_len: int) -> dict:
    """The KV samples taken after each step, weighted by the step's duration."""
    samples = [s for s in steps if s.kv.held]
    total = sum(s.seconds for s in samples) or 1.0

    def avg(value) -> float:
        return sum(s.seconds * value(s.kv) for s in samples) / total

    return {
        "definition": KV_DEFINITION,
        "paged": avg(lambda kv: kv.held / kv.slots),
        "contiguous": avg(lambda kv: kv.held / (kv.running * max_model_len)),
        "mean_running_seqs": avg(lambda kv: kv.running),
        "max_running_seqs": max((s.kv.running for s in samples), default=0),
        "mean_tokens_held": avg(lambda kv: kv.held),
        "max_tokens_held": max((s.kv.held for s in samples), default=0),
        "mean_slots_allocated": avg(lambda kv: kv.slots),
        "samples": len(samples),
    }


def kv_capacity(kv: dict, num_blocks: int, block_size: int, max_model_len: int) -> dict:
    """How many sequences of the mean size each scheme fits in the engine's KV memory."""
    slots = num_blocks * block_size
    running = kv["mean_running_seqs"]
    per_seq = kv["mean_tokens_held"] / running if running else 0
    slots_per_seq = kv["mean_slots_allocated"] / running if running else 0
    return {
        "kv_slots": slots,
        "mean_tokens_per_seq": per_seq,
        "mean_slots_per_seq": slots_per_seq,
        # the figure: KV memory / mean tokens per sequence
        "paged_seqs_fit": int(slots / per_seq) if per_seq else 0,
        # the same with each sequence's last, partly filled block counted in full
        "paged_seqs_fit_whole_blocks": int(slots / slots_per_seq) if slots_per_seq else 0,
        "contiguous_seqs_fit": slots // max_model_len,
    }


# -- HF generate ----------------------------------------------------------------------------
def run_hf(model_path: Path, dtype, device, workload: Workload, batch_size: int,
           sort: bool) -> Result:
    """A fresh model, a warm-up batch, then the workload timed batch by batch."""
    from transformers import AutoModelForCausalLM

    batches = _batches(workload, batch_size, sort)
    config = f"batch_size={batch_size}, {'length-sorted' if sort else 'arrival order'}"
    with PeakMemory(device) as mem:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
        model = model.to(device).eval()
        model.generation_config.eos_token_id = None  # ignore_eos: every row runs to the end
        _hf_batch(model, workload, batches[0][:2], device, max_new_tokens=4)  # warm-up
        start = time.perf_counter()
        padded = 0
        for batch in tqdm(batches, desc=f"HF {workload.name} ({config})", unit="batch"):
            padded += _hf_batch(model, workload, batch, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    del model
    release_memory()
    extra = {"batch_size": batch_size, "sorted": sort, "num_batches": len(batches),
             "token_slots_computed": padded, "memory": mem.as_dict()}
    return make_result("HF generate", config, seconds, workload, mem.peak_bytes, extra)


def _batches(workload: Workload, batch_size: int, sort: bool) -> list[list[int]]:
    n = workload.num_requests
    order = list(range(n))
    if sort:  # fewest wasted decode steps, then least prompt padding
        order.sort(key=lambda i: (workload.output_lens[i], len(workload.prompts[i])))
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def _hf_batch(model, workload: Workload, batch: list[int], device,
              max_new_tokens: int | None = None) -> int:
    """Generate one left-padded batch; return the token positions it computed."""
    prompts = [workload.prompts[i] for i in batch]
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    new = max_new_tokens or max(workload.output_lens[i] for i in batch)
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids.to(device), attention_mask=mask.to(device), do_sample=False,
            pad_token_id=0, max_new_tokens=new,
        )
    return len(batch) * (width + new - 1)
