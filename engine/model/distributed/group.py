"""The tensor-parallel process group: torch.distributed's gloo (CPU) or NCCL (CUDA).

Ranks meet at a TCPStore that rank 0 (the engine's process) hosts on a free
loopback port. The group is built as a torch.distributed backend object of its
own, not as the process-wide default group, so an engine can be closed and
another built in the same process (tests, a server restarting its engine).

Only four collectives are needed, all called from the engine's one thread on
rank 0 and the main thread of every worker, in the same order everywhere:

    broadcast   rank 0 -> all   each step's encoded inputs, and commands
    all_reduce  sum             after each row-parallel projection and the embedding
    gather      all -> rank 0   the logits of each vocabulary slice
    all_min     min             start-up agreement (the number of KV blocks)

A peer that dies closes its sockets, so a collective waiting on it fails at
once ("Connection closed by peer"), rather than after the timeout: the
timeout only bounds a peer that hangs, and is long because an idle server's
workers wait in a broadcast for the next step for as long as it stays idle.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

# Waiting for the other ranks to reach the store at start-up (they import torch first).
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)
# A collective that waits longer than this on a peer that is alive but stuck fails.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)


def host_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store, on a free loopback port (`store.port`)."""
    return dist.TCPStore("127.0.0.1", 0, size, is_master=True,
                         timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)


def join_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=RENDEZVOUS_TIMEOUT)


class TensorParallelGroup:
    def __init__(self, store: dist.TCPStore, rank: int, size: int, device: torch.device) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self._store = store  # the group keeps using it; rank 0 also hosts it
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            self._backend = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self._backend = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's `tensor` (same shape and dtype)."""
        self._backend.broadcast(tensor, 0).wait()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """The elementwise sum over ranks, in place on every rank.

        Every rank gets the same bits (the reduction is computed once per
        element and shared), so the replicated residual stream stays identical."""
        self._backend.allreduce([tensor]).wait()

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape everywhere), in rank order, on rank 0."""
        options = dist.GatherOptions()
        options.rootRank = 0
        outputs = [[torch.empty_like(tensor) for _ in range(self.size)]] if self.rank == 0 else []
        self._backend.gather(outputs, [tensor], options).wait()
        return outputs[0] if self.rank == 0 else None

    def all_min(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._backend.allreduce([tensor], options).wait()
        return int(tensor.item())
