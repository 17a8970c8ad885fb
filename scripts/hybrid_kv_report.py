"""KV memory of one long sequence in a model mixing sliding and global layers,
with the sliding layers' own pool (the default) and without it.

    .venv/bin/python scripts/make_shape_folder.py gemma-3-1b /tmp/gemma-3-1b
    .venv/bin/python scripts/hybrid_kv_report.py /tmp/gemma-3-1b [PROMPT_TOKENS [MAX_NUM_SEQS]]

BENCHMARK-ONLY (random weights, `--load-format dummy`). For each setting it
prints the blocks of each pool, the tokens the KV budget holds, and the K/V
bytes one sequence of PROMPT_TOKENS + 32 generated tokens holds at its end.
The window pool is sized for MAX_NUM_SEQS windows (engine/model/kv_groups.py),
so the tokens the budget holds grow as MAX_NUM_SEQS shrinks.
"""

from __future__ import annotations

import sys

from engine import EngineConfig, LLMEngine, SamplingParams


def held_bytes(engine: LLMEngine) -> tuple[int, int, int]:
    """(full pool blocks held, window pool blocks held, K/V bytes they hold)."""
    runner, manager = engine.runner, engine.block_manager
    groups = runner.kv_groups
    full = manager.num_usable_blocks - manager.num_free_blocks
    window_pool = manager.window if groups.hybrid else None
    window = window_pool.num_usable_blocks - window_pool.num_free_blocks if window_pool else 0
    layer_bytes = runner.layer_block_bytes()
    total = (full * len(groups.full_layers) + window * len(groups.window_layers)) * layer_bytes
    return full, window, total


def run(folder: str, prompt_tokens: int, max_num_seqs: int, hybrid: bool) -> None:
    engine = LLMEngine(EngineConfig(
        model=folder, load_format="dummy", dtype="bfloat16", max_model_len=8192,
        max_num_batched_tokens=512, enable_prefix_caching=False, max_num_seqs=max_num_seqs,
        disable_hybrid_kv_cache_manager=not hybrid))
    runner = engine.runner
    engine.add_request("long", list(range(1000, 1000 + prompt_tokens)),
                       SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    last = peak = (0, 0, 0)
    while engine.has_unfinished_requests():
        engine.step()
        if engine.has_unfinished_requests():
            last = held_bytes(engine)
            peak = max(peak, last, key=lambda held: held[2])
    block = engine.config.block_size
    print(f"{'two pools' if hybrid else 'one pool '}: {runner.num_blocks} full-pool blocks "
          f"({runner.num_blocks * block} tokens in the 1 GiB budget), {runner.num_window_blocks} "
          f"window-pool blocks; at the end the sequence holds {last[0]} + {last[1]} blocks = "
          f"{last[2] / 2**20:.1f} MiB of K/V (peak {peak[2] / 2**20:.1f} MiB)", flush=True)
    engine.close()


def main() -> None:
    folder = sys.argv[1]
    prompt_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
    max_num_seqs = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    for hybrid in (False, True):
        run(folder, prompt_tokens, max_num_seqs, hybrid)


if __name__ == "__main__":
    main()
