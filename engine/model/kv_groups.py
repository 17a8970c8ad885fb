"""KV-cache groups: which layers' K/V live in which pool, and how big each pool is.

Most models keep every layer's K/V in one tensor, [2, layers, blocks, block_size,
kv_heads, head_dim]. A model that mixes sliding-window and global layers (Gemma
2/3, Qwen2 with max_window_layers) keeps two, one per group, each with its own
block table (engine/core/hybrid_blocks.py decides the blocks):

    layer:         0  1  2  3  4  5  6  7  8  9 10 11     S sliding, G global
    kind:          S  S  S  S  S  G  S  S  S  S  S  G
    full pool:     [2, 2 layers (5, 11),  full blocks,   ...]
    window pool:   [2, 10 layers,         window blocks, ...]

A sliding layer only reads a sequence's last W tokens, so the window pool is
sized for that: every running sequence's window (plus the block it is filling)
and one step's new tokens, and never more blocks than the full pool has. The
rest of the memory budget goes to the full pool, so the same bytes hold more
tokens than one pool of all layers would.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig


@dataclass(frozen=True)
class KVGroups:
    full_layers: tuple[int, ...]  # the layers whose K/V live in the main pool
    window_layers: tuple[int, ...]  # the sliding layers with their own pool; () for one pool
    window: int | None  # their window (tokens), None for one pool

    @classmethod
    def plan(cls, sliding_windows: tuple[int | None, ...], config: EngineConfig) -> KVGroups:
        """Two groups when some layers slide by one window shorter than max_model_len
        and others don't (and config.hybrid_kv_cache allows it); one otherwise."""
        windows = {w for w in sliding_windows if w is not None}
        one_pool = cls(tuple(range(len(sliding_windows))), (), None)
        if not config.hybrid_kv_cache or len(windows) != 1 or None not in sliding_windows:
            return one_pool
        window = windows.pop()
        if config.max_model_len and window >= config.max_model_len:
            return one_pool  # the window never leaves anything behind
        full = tuple(i for i, w in enumerate(sliding_windows) if w is None)
        sliding = tuple(i for i, w in enumerate(sliding_windows) if w is not None)
        return cls(full, sliding, window)

    @property
    def hybrid(self) -> bool:
        return bool(self.window_layers)

    def _window_blocks(self, config: EngineConfig) -> int:
        """Blocks a running sequence's window spans, with the block it is filling."""
        return -(-(self.window - 1) // config.block_size) + 2

    def window_blocks_per_sequence(self, config: EngineConfig) -> int:
        """Most window blocks one sequence holds in a step: its window, the block
        it is filling, and a chunk of up to max_num_batched_tokens."""
        return self._window_blocks(config) + -(-config.max_num_batched_tokens // config.block_size)

    def window_blocks_wanted(self, config: EngineConfig) -> int:
        """Window blocks that never make the window pool the one that runs out:
        every running sequence's window, plus one step's new tokens, plus the null block."""
        step_blocks = -(-config.max_num_batched_tokens // config.block_size)
        return config.max_num_seqs * self._window_blocks(config) + step_blocks + 1

    def split(self, budget_bytes: int, layer_block_bytes: int,
              config: EngineConfig) -> tuple[int, int]:
        """(full blocks, window blocks) that fit in `budget_bytes`, where one block
        of one layer's K and V costs `layer_block_bytes`."""
        num_layers = len(self.full_layers) + len(self.window_layers)
        one_pool = budget_bytes // (layer_block_bytes * num_layers)
        if not self.hybrid:
            return one_pool, 0
        window = min(self.window_blocks_wanted(config), one_pool)
        left = budget_bytes - window * layer_block_bytes * len(self.window_layers)
        return left // (layer_block_bytes * len(self.full_layers)), window

    def layer_caches(self, kv_cache, window_cache):
        """What the model's layers index as kv_cache[0 or 1][layer]: (K of every
        layer, V of every layer), views into the pool or pools made once here.
        Why not the pool tensor itself: indexing it twice a layer cost ~9 us,
        ~0.3 ms of a one-stream SmolLM2 step on AVX2."""
        num_layers = len(self.full_layers) + len(self.window_layers)
        keys, values = [None] * num_layers, [None] * num_layers
        for pool, layers in ((kv_cache, self.full_layers), (window_cache, self.window_layers)):
            for slot, layer in enumerate(layers):
                keys[layer], values[layer] = pool[0][slot], pool[1][slot]
        return tuple(keys), tuple(values)
