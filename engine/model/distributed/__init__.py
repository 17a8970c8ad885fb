"""Tensor parallelism on torch.distributed: one model over several devices.

    partition.py  which slice of every weight and KV head a rank holds
    group.py      the process group (gloo on CPU, NCCL on CUDA) and its collectives
    executor.py   rank 0, in the engine's process: starts the workers, shares each step
    worker.py     ranks 1..N-1: `python -m engine.model.distributed.worker`, one per device

Nothing is imported here, so that the model code can import partition.py
without pulling in the process management above it.
"""
