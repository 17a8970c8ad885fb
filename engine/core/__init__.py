"""The pure-Python heart of the engine, tested by exact block ids.

    scheduler.py      waiting/running queues, token budget, chunked prefill, preemption
    sched_output.py   SchedulerOutput: plain data, the only thing model/ sees of a step
    block_manager.py  blocks, free list, ref counts, the prefix-cache table, eviction
    block_hash.py     chained block hashes every replica computes alike
    sequence.py       one request's tokens, blocks and status
    kv_events.py      vLLM-format KV events (BlockStored / BlockRemoved) for routers
    kv_offload/       host, disk and Redis tiers under the prefix cache

Nothing here imports model/, sampling/ internals that run the model, or frontend/.
"""
