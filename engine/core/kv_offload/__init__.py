"""KV cache offload: slower, larger tiers under the device prefix cache.

    tier.py       what a tier is (contains / load / store by block hash, bounded in bytes)
    record.py     one block's bytes as every tier stores them: hash, namespace, checksum
    host.py       host memory: a fixed pool of record slots, LRU
    disk.py       a folder of files named by hash, bounded in bytes, LRU
    redis_tier.py a Redis the fleet shares, bounded by TTL and Redis's maxmemory
    offload.py    the manager: which blocks to store, and loading blocks before a
                  sequence's first step (engine/core/scheduler.py asks it at admission)
    lookup.py     asking the remote tiers in the background: no step waits on the network

`build_offload` makes the manager an EngineConfig asks for (None: no tiers).
"""

from __future__ import annotations

from engine.core.block_hash import cache_namespace
from engine.core.block_manager import BlockManager
from engine.config import EngineConfig
from engine.core.kv_offload import record
from engine.core.kv_offload.offload import BlockIO, KVOffload
from engine.core.kv_offload.tier import Tier


def build_tiers(config: EngineConfig, namespace: str, payload_bytes: int,
                pin_memory: bool = False) -> list[Tier]:
    """The configured tiers, fastest first: host memory, disk, Redis."""
    from engine.core.kv_offload.disk import DiskTier
    from engine.core.kv_offload.host import HostTier
    from engine.core.kv_offload.redis_tier import RedisTier

    tiers: list[Tier] = []
    record_bytes = record.record_size(namespace, payload_bytes)
    if config.kv_offload_host_bytes:
        tiers.append(HostTier(namespace, config.kv_offload_host_bytes, record_bytes, pin_memory))
    if config.kv_offload_disk_dir:
        tiers.append(DiskTier(namespace, config.kv_offload_disk_dir, config.kv_offload_disk_bytes))
    if config.kv_offload_redis_url:
        tiers.append(RedisTier(namespace, config.kv_offload_redis_url, config.kv_offload_redis_ttl))
    return tiers


def build_offload(config: EngineConfig, block_manager: BlockManager, io: BlockIO, *,
                  fingerprint: bytes, kv_cache_dtype: str, payload_bytes: int,
                  pin_memory: bool = False) -> KVOffload | None:
    """The offload manager over the configured tiers, or None when there are none.
    `kv_cache_dtype` names the cache's dtype ("int8"): in every record's namespace,
    so a replica never loads a block of another layout."""
    if not config.kv_offload_enabled:
        return None
    namespace = cache_namespace(fingerprint, config.block_size, kv_cache_dtype)
    tiers = build_tiers(config, namespace, payload_bytes, pin_memory)
    # Loads may hold what one longest sequence leaves free: whoever is ready first fits.
    longest = block_manager.blocks_for(config.max_model_len)
    max_job_blocks = max(block_manager.num_usable_blocks - longest, 0)
    return KVOffload(tiers, block_manager, io, payload_bytes,
                     config.kv_offload_store_threshold, max_job_blocks)


__all__ = ["KVOffload", "Tier", "build_offload", "build_tiers"]
