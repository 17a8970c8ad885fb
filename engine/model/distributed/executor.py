"""Rank 0 of a tensor-parallel engine: the workers, and each step shared with them.

    engine process (rank 0)                          worker processes (ranks 1..N-1)
    ───────────────────────                          ───────────────────────────────
    Scheduler, BlockManager, sampler                  python -m engine.model.distributed.worker
    TensorParallelRunner.execute(output):             loop:
        encode the step (engine/model/step_inputs.py)           header  <- broadcast
        broadcast header, payload ───────────────────►    payload <- broadcast
        run_step: forward on rank 0's slice ◄─ all-reduce ─► run_step: forward on its slice
        logits  ◄──────────── gather ───────────────────  (its vocabulary slice's logits)
        sample on rank 0

The workers are plain child processes (`subprocess`, spawned fresh), not
forks and not multiprocessing children, so a user's script needs no
`if __name__ == "__main__"` guard. A worker's stdin carries its start-up
spec and then stays open: when the engine's process dies, the worker reads
end-of-file and exits, so none outlives it. Its stdout carries one status line
("started", or the error it died of).

A watch thread per worker waits for its exit. An exit the engine did not ask
for marks the engine failed and kills the other workers at once; their
sockets close, so any collective rank 0 is waiting in fails within
milliseconds, and every later call raises WorkerFailedError.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.model.distributed.group import RENDEZVOUS_TIMEOUT, TensorParallelGroup, host_store
from engine.model.distributed.partition import Partition
from engine.model.model_runner import ModelRunner, ModelRunnerOutput
from engine.model.placement import resolve_device
from engine.model.models.registry import model_class
from engine.core.sched_output import SchedulerOutput
from engine.model.step_inputs import HEADER_LEN, Op

logger = logging.getLogger(__name__)

STOP_TIMEOUT = 10.0  # seconds a worker has to exit after the stop command


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker died: the engine cannot step any more."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to start, pickled onto its stdin."""

    config: EngineConfig
    model_path: Path
    rank: int
    store_port: int


class Workers:
    """Ranks 1..N-1 as child processes, each with a thread that waits for its exit."""

    def __init__(self, config: EngineConfig, model_path: Path, store_port: int) -> None:
        self.size = config.tensor_parallel_size
        self.failure: str | None = None
        self.stopping = False
        self._lock = threading.Condition()
        self._started = 0
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, self.size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "engine.model.distributed.worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_worker_env())
            proc.stdin.write(pickle.dumps(WorkerSpec(config, model_path, rank, store_port)))
            proc.stdin.flush()
            self.procs.append(proc)
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True,
                             name=f"tp-worker-{rank}-watch").start()

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        error = ""
        for line in proc.stdout:
            text = line.decode(errors="replace").strip()
            if text == "started":
                with self._lock:
                    self._started += 1
                    self._lock.notify_all()
            elif text.startswith("error "):
                error = text.removeprefix("error ")
        code = proc.wait()
        if self.stopping:
            return
        reason = f"tensor-parallel worker {rank} (pid {proc.pid}) exited with code {code}"
        self.fail(f"{reason}: {error}" if error else reason)

    def fail(self, reason: str) -> None:
        """Record the first failure and take every other worker down with it."""
        with self._lock:
            if self.failure is None:
                self.failure = reason
                logger.error("%s; stopping the other workers", reason)
            self._lock.notify_all()
        self.kill()

    def wait_started(self) -> None:
        """Until every worker has read its spec (and is about to join the group)."""
        with self._lock:
            done = self._lock.wait_for(
                lambda: self._started == len(self.procs) or self.failure is not None,
                RENDEZVOUS_TIMEOUT.total_seconds())
        if self.failure is not None:
            raise WorkerFailedError(self.failure)
        if not done:
            self.fail("tensor-parallel workers did not start in time")
            raise WorkerFailedError(self.failure)

    def wait_for_failure(self, seconds: float) -> str | None:
        """The failure, waiting up to `seconds` for a watch thread to see it."""
        with self._lock:
            self._lock.wait_for(lambda: self.failure is not None, seconds)
            return self.failure

    def stop(self) -> None:
        """After the stop command: let the workers exit, then make sure they have."""
        self.stopping = True
        for proc in self.procs:
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker pid %d did not stop; killing it", proc.pid)
        self.kill()

    def kill(self) -> None:
        """Kill whatever still runs and reap it (safe to repeat, from any thread)."""
        _kill(self.procs)

    def abandon(self) -> None:
        """Kill them all as a matter of course (the engine is going): no failure."""
        self.stopping = True
        self.kill()


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass


def _worker_env() -> dict[str, str]:
    """The engine's own environment, with this checkout importable (it may not be installed)."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def check_devices(config: EngineConfig) -> None:
    """On CUDA, one GPU per rank from the one the config names."""
    device = resolve_device(config)
    if device.type != "cuda":
        return
    first, size = device.index or 0, config.tensor_parallel_size
    available = torch.cuda.device_count()
    if first + size > available:
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} GPUs from cuda:{first}, but this "
            f"machine has {available}")


class TensorParallelRunner(ModelRunner):
    """A ModelRunner holding rank 0's slice, with the other ranks in worker processes."""

    def __init__(self, config: EngineConfig, hf_config, model_path, eos_token_ids) -> None:
        size = config.tensor_parallel_size
        Partition.of(model_class(hf_config, size).model_args(hf_config), 0, size)  # refuses a bad size
        check_devices(config)
        store = host_store(size)
        self.workers = Workers(config, Path(model_path), store.port)
        # The runner garbage-collected or the interpreter exiting without close().
        self._finalizer = weakref.finalize(self, self.workers.abandon)
        self.closed = False
        try:
            self.workers.wait_started()
            device = resolve_device(config)
            if device.type == "cuda":
                torch.cuda.set_device(device)  # NCCL works on the current device
            group = TensorParallelGroup(store, 0, size, device)
            super().__init__(config, hf_config, model_path, eos_token_ids, group)
            self.rank_memory = gather_memory(self)
        except RuntimeError as exc:  # a collective failed: a worker died first
            failure = self.workers.wait_for_failure(2.0)
            self.workers.kill()
            raise WorkerFailedError(failure or str(exc)) from exc
        except BaseException:  # rank 0's own error (the workers meet the same one)
            self.workers.abandon()
            raise

    def memory_per_rank(self) -> list[dict[str, int]]:
        return self.rank_memory  # gathered from every rank once, at start-up

    @property
    def failure(self) -> str | None:
        """Why the runner cannot step (a worker died), or None."""
        return self.workers.failure

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return self._collective(super().execute, output)

    def share(self, header: list[int], payload: torch.Tensor) -> torch.Tensor:
        self._send(header, payload)
        return payload

    def _send(self, header: list[int], payload: torch.Tensor | None = None) -> None:
        head = torch.tensor(header + [0] * (HEADER_LEN - len(header)), dtype=torch.long)
        self.group.broadcast(head.to(self.device))
        if payload is not None:
            self.group.broadcast(payload)

    def _collective(self, fn, *args):
        """Run `fn` (which talks to the workers), turning a dead worker into WorkerFailedError."""
        if self.failure is not None:
            raise WorkerFailedError(self.failure)
        if self.closed:
            raise WorkerFailedError("the tensor-parallel runner is closed")
        try:
            return fn(*args)
        except BaseException as exc:
            # The ranks are out of step now, whether a peer died (its socket
            # closed: give its watch thread a moment to say why) or rank 0
            # failed halfway through a step: the group cannot go on.
            failure = self.workers.wait_for_failure(2.0) if isinstance(exc, RuntimeError) else None
            self.workers.fail(failure or f"a tensor-parallel step failed on rank 0: {exc!r}")
            raise WorkerFailedError(self.workers.failure) from exc

    # -- offload tiers: a block's record is every rank's slice, rank after rank ----------
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self._collective(self._read_blocks, block_ids)

    def _read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        self._send([Op.READ_BLOCKS, len(block_ids)], self._tensor(block_ids))
        slices = self.group.gather(self.block_rows(block_ids))
        return self.to_host(torch.cat(slices, dim=1))

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self._collective(self._write_blocks, block_ids, data)

    def _write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self._send([Op.WRITE_BLOCKS, len(block_ids)], self._tensor(block_ids))
        data = data.to(self.device).contiguous()
        self.group.broadcast(data)
        super().write_blocks(block_ids, data[:, : self.bytes_per_block()].contiguous())

    # -- LoRA adapters: every rank reads its own slice from the adapter's folder --------
    def add_lora(self, request) -> bytes:
        new = self.lora is not None and request.lora_int_id not in self.lora.known
        digest = super().add_lora(request)  # rank 0 checks it first: a bad folder goes no further
        if new:
            self._collective(self._send_lora, request)
        return digest

    def _send_lora(self, request) -> None:
        data = json.dumps(dataclasses.asdict(request)).encode()
        self._send([Op.ADD_LORA, len(data)], torch.tensor(list(data), dtype=torch.uint8,
                                                          device=self.device))

    def remove_lora(self, lora_id: int) -> bool:
        found = super().remove_lora(lora_id)
        self._collective(self._send, [Op.REMOVE_LORA, lora_id])
        return found

    # -- shutdown ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers and wait for them (safe to repeat)."""
        if self.closed:
            return
        self.closed = True
        self.workers.stopping = True  # from now on a worker's exit is expected
        if self.failure is None:
            try:
                self._send([Op.STOP])
            except RuntimeError:
                pass  # a worker is already gone: stop() kills the rest
        self.workers.stop()
        self._finalizer.detach()


def gather_memory(runner: ModelRunner) -> list[dict[str, int]] | None:
    """Every rank's runner.memory(), on rank 0 (each rank calls it once at start-up)."""
    memory = runner.memory()
    values = torch.tensor([memory["weights_bytes"], memory["kv_cache_bytes"]],
                          dtype=torch.long, device=runner.device)
    gathered = runner.group.gather(values)
    if gathered is None:
        return None
    return [{"weights_bytes": int(w), "kv_cache_bytes": int(k)}
            for w, k in (t.tolist() for t in gathered)]
