"""LLMEngine.stats(): the engine's counters and gauges, read for /metrics.

Flat {name: int} so the service can snapshot it cheaply between steps.
Cumulative counters never go down. Keys that exist only with a feature:

    spec_decode_*                          --speculative-config (vLLM's names)
    num_requests_{running,waiting}_priority_{p}   --scheduling-policy priority
"""

from __future__ import annotations


def engine_stats(engine) -> dict[str, int]:
    cache = engine.block_manager.stats
    scheduler, blocks = engine.scheduler, engine.block_manager
    return {
        "num_requests_running": len(scheduler.running),
        "num_requests_waiting": len(scheduler.waiting),
        "prompt_tokens": engine.num_prompt_tokens,
        "generation_tokens": engine.num_generation_tokens,
        "prefix_cache_queries": cache.queries,
        "prefix_cache_hits": cache.hits,
        "prompt_tokens_computed": scheduler.num_prompt_tokens_computed,
        "evictions": cache.evictions,
        "num_preemptions": scheduler.num_preemptions,
        "kv_blocks_free": blocks.num_free_blocks,
        "kv_blocks_total": blocks.num_usable_blocks,
        "kv_blocks_cached": blocks.num_cached_blocks,
        "prefix_warm_blocks": blocks.num_popular_cached,
        **_spec_stats(engine.speculator),
        **_priority_stats(scheduler),
    }


def _spec_stats(speculator) -> dict[str, int]:
    """Speculative decoding's counters, none without it."""
    if speculator is None:
        return {}
    stats = speculator.stats
    per_position = {f"spec_decode_num_accepted_tokens_pos_{i}": count
                    for i, count in enumerate(stats.accepted_per_position)}
    return {"spec_decode_num_drafts": stats.num_drafts,
            "spec_decode_num_draft_tokens": stats.num_draft_tokens,
            "spec_decode_num_accepted_tokens": stats.num_accepted_tokens, **per_position}


def _priority_stats(scheduler) -> dict[str, int]:
    """Under the priority policy: running and waiting sequences per priority value."""
    if not scheduler.by_priority:
        return {}
    counts: dict[str, int] = {}
    for state, seqs in (("running", scheduler.running),
                        ("waiting", [*scheduler.waiting, *scheduler.loading])):
        for seq in seqs:
            key = f"num_requests_{state}_priority_{seq.priority}"
            counts[key] = counts.get(key, 0) + 1
    return counts
