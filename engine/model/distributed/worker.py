"""A tensor-parallel worker: ranks 1..N-1, one process each.

Started by engine/model/distributed/executor.py as `python -m engine.model.distributed.worker`
with a pickled WorkerSpec on stdin. It joins the process group, loads its
slice of the model (ModelRunner with the group), and then does whatever rank 0
broadcasts, until the stop command:

    header <- broadcast          [op, ...] (engine/model/step_inputs.py)
      STEP          payload <- broadcast; run_step (its all-reduces and the logits gather)
      READ_BLOCKS   block ids <- broadcast; its slice of the blocks -> gather
      WRITE_BLOCKS  block ids, then every rank's bytes <- broadcast; it writes its slice
      STOP          exit 0

It samples nothing and keeps no request state: each step's header and payload
say all it needs. When the engine's process dies, stdin reaches end-of-file
and the worker exits at once.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import threading

import torch

from engine.model.distributed.executor import gather_memory
from engine.model.distributed.group import TensorParallelGroup, join_store
from engine.model.lora.request import LoRARequest
from engine.model.model_runner import ModelRunner
from engine.model.placement import resolve_device
from engine.model.models.loader import load_hf_config
from engine.model.step_inputs import HEADER_LEN, Op, payload_length


def main() -> None:
    spec = pickle.load(sys.stdin.buffer)
    # Ctrl-C in a terminal reaches the whole process group: the engine decides
    # when its workers stop, so they ignore it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_engine, daemon=True).start()
    _say("started")
    try:
        runner = _start(spec)
        serve(runner)
    except BaseException as exc:  # noqa: BLE001 - the engine learns why from stdout
        _say("error " + " ".join(f"{type(exc).__name__}: {exc}".split()))
        raise


def _start(spec) -> ModelRunner:
    config = spec.config
    size = config.tensor_parallel_size
    device = resolve_device(config, spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TensorParallelGroup(join_store(spec.store_port, size), spec.rank, size, device)
    runner = ModelRunner(config, load_hf_config(spec.model_path), spec.model_path, (), group)
    gather_memory(runner)
    runner.use_configured_threads()
    return runner


def serve(runner: ModelRunner) -> None:
    group, device = runner.group, runner.device
    head = torch.empty(HEADER_LEN, dtype=torch.long, device=device)
    while True:
        group.broadcast(head)
        header = head.tolist()
        op = header[0]
        if op == Op.STOP:
            return
        if op == Op.STEP:
            payload = torch.empty(payload_length(header), dtype=torch.long, device=device)
            group.broadcast(payload)
            runner.run_step(header, payload)
            continue
        if op in (Op.ADD_LORA, Op.REMOVE_LORA):
            lora_command(runner, header)
            continue
        block_ids = torch.empty(header[1], dtype=torch.long, device=device)
        group.broadcast(block_ids)
        ids = block_ids.tolist()
        if op == Op.READ_BLOCKS:
            group.gather(runner.block_rows(ids))
        elif op == Op.WRITE_BLOCKS:
            width = runner.bytes_per_block()
            data = torch.empty(len(ids), width * group.size, dtype=torch.uint8, device=device)
            group.broadcast(data)
            runner.write_blocks(ids, data[:, group.rank * width : (group.rank + 1) * width].contiguous())
        else:
            raise RuntimeError(f"unknown command {op} from rank 0")


def lora_command(runner: ModelRunner, header: list[int]) -> None:
    """Rank 0 added an adapter (its LoRARequest follows, as JSON) or removed one."""
    if header[0] == Op.REMOVE_LORA:
        runner.remove_lora(header[1])
        return
    data = torch.empty(header[1], dtype=torch.uint8, device=runner.device)
    runner.group.broadcast(data)
    runner.add_lora(LoRARequest(**json.loads(bytes(data.tolist()))))


def _exit_with_engine() -> None:
    """Exit as soon as the engine's process goes (its end of stdin closes)."""
    # The raw file descriptor, not sys.stdin: a thread blocked in a buffered
    # read would hold its lock when the interpreter shuts down after STOP.
    while os.read(sys.stdin.fileno(), 4096):
        pass
    os._exit(0)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
