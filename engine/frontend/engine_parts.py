"""The parts an LLMEngine builds around its runner, from the config: the
block manager (one pool, or two for a model mixing sliding and global
layers), the KV offload tiers, and the KV event publisher."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.hybrid_blocks import HybridBlockManager
from engine.core.kv_events import KVEventPublisher
from engine.core.kv_offload import KVOffload, build_offload
from engine.model.kv_cache import dtype_name


def build_block_manager(config: EngineConfig, runner) -> BlockManager:
    events = config.kv_events_endpoint is not None
    if runner.num_window_blocks:  # the sliding layers have their own pool
        return HybridBlockManager(
            runner.num_blocks, runner.num_window_blocks, config.block_size, runner.hybrid_window,
            enable_caching=config.enable_prefix_caching, record_events=events)
    return BlockManager(runner.num_blocks, config.block_size,
                        enable_caching=config.enable_prefix_caching, record_events=events,
                        sliding_window=runner.sliding_window)


def build_kv_offload(config: EngineConfig, block_manager: BlockManager, runner,
                     fingerprint: bytes) -> KVOffload | None:
    """The offload tiers' manager, when the config names a tier."""
    if not config.kv_offload_enabled:
        return None
    return build_offload(
        config, block_manager, runner, fingerprint=fingerprint,
        kv_cache_dtype=dtype_name(runner.kv_cache_dtype),
        payload_bytes=runner.block_record_bytes(),
        pin_memory=torch.device(runner.device).type == "cuda")


def build_kv_events(config: EngineConfig, block_manager: BlockManager) -> KVEventPublisher | None:
    """The publisher of the block manager's events, when an endpoint is set."""
    endpoint = config.kv_events_endpoint
    if endpoint is None:
        return None
    if block_manager.events is None:
        raise ValueError("kv_events_endpoint is set but the given scheduler's block "
                         "manager records no events (record_events=True)")
    return KVEventPublisher(endpoint, config.kv_events_topic,
                            replay_endpoint=config.kv_events_replay_endpoint,
                            buffer_steps=config.kv_events_buffer_steps)
