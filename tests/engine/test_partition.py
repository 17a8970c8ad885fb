"""Which slice of each weight a tensor-parallel rank holds: exact rows and columns.

A fake lazy slice records what each rank reads, so the tests see that a rank
asks the checkpoint for its own rows or columns only, and that the slices of
all ranks put back together are the whole tensor.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model.distributed.partition import (
    Partition,
    check_tensor_parallel_size,
    valid_tensor_parallel_sizes,
)


def llama_args(heads=9, kv_heads=3, head_dim=4, hidden=36, intermediate=18, vocab=50):
    return SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                           hidden_size=hidden, intermediate_size=intermediate, vocab_size=vocab)


class LazySlice:
    """safetensors' get_slice(): indexing reads only what is asked (recorded here)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.reads: list = []

    def get_shape(self):
        return list(self.tensor.shape)

    def __getitem__(self, index):
        self.reads.append(index)
        return self.tensor[index].clone()


def shards(args, size: int, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
    return [Partition.of(args, rank, size).shard_checkpoint_tensor(name, LazySlice(tensor))
            for rank in range(size)]


def test_smollm2_shape_over_three_ranks():
    # 9 heads, 3 KV heads: three query heads and one KV head each.
    parts = [Partition.of(llama_args(), rank, 3) for rank in range(3)]
    assert [(p.head_start, p.num_heads) for p in parts] == [(0, 3), (3, 3), (6, 3)]
    assert [(p.kv_head_start, p.num_kv_heads) for p in parts] == [(0, 1), (1, 1), (2, 1)]
    assert [p.intermediate_size for p in parts] == [6, 6, 6]
    assert [(p.vocab_start, p.vocab_rows) for p in parts] == [(0, 17), (17, 17), (34, 17)]


def test_fewer_kv_heads_than_ranks_replicates_them():
    # 4 heads, 2 KV heads over 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1.
    args = llama_args(heads=4, kv_heads=2, hidden=16, intermediate=8)
    parts = [Partition.of(args, rank, 4) for rank in range(4)]
    assert [p.head_start for p in parts] == [0, 1, 2, 3]
    assert [(p.kv_head_start, p.num_kv_heads) for p in parts] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    k_proj = torch.arange(2 * 4 * 16, dtype=torch.float32).view(8, 16)
    pieces = shards(args, 4, "model.layers.0.self_attn.k_proj.weight", k_proj)
    assert torch.equal(pieces[0], k_proj[:4]) and torch.equal(pieces[1], k_proj[:4])
    assert torch.equal(pieces[2], k_proj[4:]) and torch.equal(pieces[3], k_proj[4:])


def test_column_and_row_parallel_slices_rebuild_the_tensor():
    args = llama_args()
    q = torch.randn(36, 36)
    o = torch.randn(36, 36)
    gate = torch.randn(18, 36)
    down = torch.randn(36, 18)
    layer = "model.layers.3."
    assert torch.equal(torch.cat(shards(args, 3, layer + "self_attn.q_proj.weight", q)), q)
    assert torch.equal(torch.cat(shards(args, 3, layer + "self_attn.o_proj.weight", o), 1), o)
    assert torch.equal(torch.cat(shards(args, 3, layer + "mlp.gate_proj.weight", gate)), gate)
    assert torch.equal(torch.cat(shards(args, 3, layer + "mlp.down_proj.weight", down), 1), down)
    q_bias = torch.randn(36)
    assert torch.equal(torch.cat(shards(args, 3, layer + "self_attn.q_proj.bias", q_bias)), q_bias)


def test_a_rank_reads_only_its_slice_of_the_checkpoint():
    args = llama_args()
    lazy = LazySlice(torch.randn(36, 36))
    Partition.of(args, 1, 3).shard_checkpoint_tensor("model.layers.0.self_attn.q_proj.weight", lazy)
    assert lazy.reads == [slice(12, 24)]
    lazy = LazySlice(torch.randn(36, 18))
    Partition.of(args, 2, 3).shard_checkpoint_tensor("model.layers.0.mlp.down_proj.weight", lazy)
    assert lazy.reads == [(slice(None), slice(12, 18))]


def test_vocabulary_rows_pad_the_last_rank():
    args = llama_args(vocab=50)
    embedding = torch.randn(50, 36)
    pieces = shards(args, 3, "model.embed_tokens.weight", embedding)
    assert [p.shape[0] for p in pieces] == [17, 17, 17]
    assert torch.equal(torch.cat(pieces)[:50], embedding)
    assert torch.equal(pieces[2][16:], torch.zeros(1, 36))


def test_replicated_and_row_parallel_bias():
    args = llama_args()
    norm = torch.randn(36)
    assert all(torch.equal(p, norm) for p in shards(args, 3, "model.norm.weight", norm))
    bias = torch.randn(36)  # added once: rank 0 keeps it, the others add zeros
    pieces = shards(args, 3, "model.layers.0.mlp.down_proj.bias", bias)
    assert torch.equal(pieces[0], bias)
    assert torch.equal(pieces[1], torch.zeros(36)) and torch.equal(pieces[2], torch.zeros(36))


def test_one_rank_holds_everything():
    tensor = torch.randn(36, 36)
    part = Partition.of(llama_args())
    assert (part.num_heads, part.num_kv_heads, part.vocab_rows) == (9, 3, 50)
    assert torch.equal(part.shard_checkpoint_tensor("model.layers.0.self_attn.q_proj.weight",
                                                    LazySlice(tensor)), tensor)


def test_valid_sizes():
    assert valid_tensor_parallel_sizes(llama_args()) == [1, 3, 9]
    assert valid_tensor_parallel_sizes(llama_args(heads=4, kv_heads=2, intermediate=8)) == [1, 2, 4]
    # 32 heads, 8 KV heads: 16 and 32 replicate KV heads; an MLP of 24 rules out 16 and 32.
    assert valid_tensor_parallel_sizes(llama_args(heads=32, kv_heads=8, intermediate=24)) == [1, 2, 4, 8]


@pytest.mark.parametrize("size", [2, 4, 5])
def test_a_size_that_cannot_split_names_the_numbers_and_the_sizes_that_work(size):
    with pytest.raises(ValueError) as error:
        check_tensor_parallel_size(llama_args(), size)
    message = str(error.value)
    assert f"tensor_parallel_size={size}" in message
    assert "9 attention heads" in message and "3 KV heads" in message
    assert message.endswith("sizes that work: 1, 3, 9")
