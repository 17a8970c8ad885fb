"""Which slice of the model each tensor-parallel rank holds (Megatron-style).

With N ranks, every weight matrix of a decoder layer is cut so that each rank
computes a slice of the layer and one all-reduce per block joins them:

    attention   qkv_proj (column-parallel)  rank r: its query heads, its KV heads
                o_proj   (row-parallel)     rank r: the input columns of its heads
                                            -> all-reduce (sum) of the partial outputs
    MLP         gate_up  (column-parallel)  rank r: 1/N of the intermediate features
                down     (row-parallel)     rank r: those same input columns
                                            -> all-reduce (sum)
    embedding   vocab-parallel              rank r: 1/N of the vocabulary rows; a token
                                            outside them embeds to 0 -> all-reduce
    LM head     vocab-parallel              rank r: the logits of its rows -> gather

Query heads split evenly. KV heads split evenly when there are at least N of
them; with fewer, each rank keeps the one KV head its query heads read
(replicated on N / num_kv_heads ranks), as vLLM does:

    9 heads, 3 KV heads, N = 3:   rank 0: q 0-2, kv 0 | rank 1: q 3-5, kv 1 | rank 2: q 6-8, kv 2
    4 heads, 2 KV heads, N = 4:   rank 0: q 0, kv 0   | rank 1: q 1, kv 0   | rank 2: q 2, kv 1 ...

The vocabulary needs no divisibility: each rank holds ceil(V / N) rows and the
last one's tail is zero padding, cut off after the gather. Norms and RoPE
tables are small and replicated. Every rank reads only its slice of each
checkpoint tensor (`shard_checkpoint_tensor`), never the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Partition:
    rank: int
    size: int
    num_heads: int  # query heads on this rank
    head_start: int  # the first of them, in the model's numbering
    num_kv_heads: int  # KV heads on this rank (their cache is this rank's)
    kv_head_start: int
    head_dim: int
    intermediate_size: int  # MLP features on this rank
    vocab_size: int  # the whole vocabulary
    vocab_rows: int  # embedding / LM-head rows on this rank (padding included)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    @classmethod
    def of(cls, args, rank: int = 0, size: int = 1) -> "Partition":
        """Rank `rank`'s slice of a model with ModelArgs `args` over `size` ranks."""
        check_tensor_parallel_size(args, size)
        heads = args.num_heads // size
        if args.num_kv_heads >= size:
            kv_heads, kv_start = args.num_kv_heads // size, rank * (args.num_kv_heads // size)
        else:  # one KV head per rank, shared by size / num_kv_heads ranks
            kv_heads, kv_start = 1, rank // (size // args.num_kv_heads)
        return cls(
            rank=rank, size=size,
            num_heads=heads, head_start=rank * heads,
            num_kv_heads=kv_heads, kv_head_start=kv_start, head_dim=args.head_dim,
            intermediate_size=args.intermediate_size // size,
            vocab_size=args.vocab_size, vocab_rows=-(-args.vocab_size // size),
        )

    # -- the checkpoint, sliced ------------------------------------------------------
    def shard_checkpoint_tensor(self, name: str, tensor_slice) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (an HF name).

        `tensor_slice` is safetensors' lazy slice (`get_slice`): indexing it
        reads only the rows or columns asked for."""
        shape = tensor_slice.get_shape()
        if self.size == 1:
            return tensor_slice[:]
        rows = self._rows_of(name)
        if rows is not None:
            start, stop = rows
            return tensor_slice[start:stop]
        columns = self._columns_of(name)
        if columns is not None:
            return tensor_slice[:, columns[0]:columns[1]]
        if name.endswith("mlp.down_proj.bias"):
            # Row-parallel: the partial sums are added up, so the bias must be added once.
            bias = tensor_slice[:]
            return bias if self.rank == 0 else torch.zeros_like(bias)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return self._vocab_rows(tensor_slice, shape)
        return tensor_slice[:]

    def _rows_of(self, name: str) -> tuple[int, int] | None:
        """The output rows a column-parallel projection keeps here."""
        if ".q_proj." in name:
            return self._span(self.head_start, self.num_heads)
        if ".k_proj." in name or ".v_proj." in name:
            return self._span(self.kv_head_start, self.num_kv_heads)
        if ".gate_proj." in name or ".up_proj." in name:
            size = self.intermediate_size
            return self.rank * size, (self.rank + 1) * size
        return None

    def _columns_of(self, name: str) -> tuple[int, int] | None:
        """The input columns a row-parallel projection keeps here."""
        if name.endswith("self_attn.o_proj.weight"):
            return self._span(self.head_start, self.num_heads)
        if name.endswith("mlp.down_proj.weight"):
            size = self.intermediate_size
            return self.rank * size, (self.rank + 1) * size
        return None

    def _span(self, first_head: int, heads: int) -> tuple[int, int]:
        return first_head * self.head_dim, (first_head + heads) * self.head_dim

    def _vocab_rows(self, tensor_slice, shape) -> torch.Tensor:
        start = self.vocab_start
        stop = min(start + self.vocab_rows, self.vocab_size)
        rows = tensor_slice[start:stop]
        if rows.shape[0] == self.vocab_rows:
            return rows
        padded = torch.zeros(self.vocab_rows, *shape[1:], dtype=rows.dtype)
        padded[: rows.shape[0]] = rows
        return padded


def valid_tensor_parallel_sizes(args) -> list[int]:
    """Every N this model splits over: N divides the query heads and the MLP
    width, and the KV heads split evenly or replicate evenly."""
    return [n for n in range(1, args.num_heads + 1) if _splits(args, n)]


def _splits(args, n: int) -> bool:
    kv = args.num_kv_heads
    return (args.num_heads % n == 0 and args.intermediate_size % n == 0
            and (kv % n == 0 or n % kv == 0))


def check_tensor_parallel_size(args, size: int) -> None:
    """Refuse a size the model cannot be split over, naming the sizes that work."""
    if size == 1 or _splits(args, size):
        return
    sizes = ", ".join(str(n) for n in valid_tensor_parallel_sizes(args))
    raise ValueError(
        f"tensor_parallel_size={size} cannot split this model: it has "
        f"{args.num_heads} attention heads, {args.num_kv_heads} KV heads and an MLP "
        f"width of {args.intermediate_size}, and the size must divide the heads and "
        f"the MLP width and divide or be a multiple of the KV heads; sizes that work: {sizes}"
    )
