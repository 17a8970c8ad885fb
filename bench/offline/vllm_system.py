"""vLLM's CPU build as a third system, driven round by round from this process.

    vllm = VllmSystem(python, folder, "float32", threads=2, texts, query, timeout_s=900)
    vllm.timed(texts)      # seconds, by vLLM's own clock in its own process
    vllm.close()

The worker (bench/offline/vllm_embed_worker.py) runs in vLLM's interpreter;
this side sends it "texts" or "query" and reads back the seconds, so vLLM takes
its turn in the same A B C rounds as the two in-process systems and a burst of
other work on the machine lands on all three. Between its turns the worker's
process group is stopped (SIGSTOP, SIGCONT before its next call): left
running, the idle worker kept both cores busy, and the two systems in this
process measured ~5x slower in float32 (1.5 embeddings/s each, where alone
they give 6-7). vLLM pins its OpenMP threads to
the first `threads` cores (VLLM_CPU_OMP_THREADS_BIND). Start-up (load, compile,
warm-up) and every call get `timeout_s`; a failure, at start or later, leaves
`error` set (the worker's last error line) and the system out of the results.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

WORKER = Path(__file__).with_name("vllm_embed_worker.py")
MARKER = "EMBEDDINGS-RESULT "  # the worker's (it imports nothing of ours, so it has its own)


class VllmFailed(RuntimeError):
    pass


class VllmSystem:
    name = "vllm"

    def __init__(self, python: Path, folder: Path, dtype: str, threads: int, texts: list[str],
                 query: str, timeout_s: float, enforce_eager: bool = False) -> None:
        self.texts, self.query, self.timeout_s = texts, query, timeout_s
        self.error: str | None = None
        self.version = self.saved_vectors = self.process = self._log = self._reader = None
        self._scratch = tempfile.TemporaryDirectory()
        scratch = Path(self._scratch.name)
        job = {"folder": str(folder), "dtype": dtype, "texts": texts, "query": query,
               "vectors": str(scratch / "vectors.npy"), "enforce_eager": enforce_eager}
        (scratch / "job.json").write_text(json.dumps(job))
        self.log_path = scratch / "vllm.log"
        try:
            self._start(python, scratch / "job.json", threads)
            ready = self._answer()
            self._signal(signal.SIGSTOP)
            self.version = ready["version"]
            self.saved_vectors = torch.from_numpy(np.load(job["vectors"]))  # of the texts
        except (VllmFailed, OSError) as exc:
            self._fail(str(exc))

    def _start(self, python: Path, job_file: Path, threads: int) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS=str(threads),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [str(python), str(WORKER), str(job_file)], env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            start_new_session=True)  # its own group: vLLM's engine process stops with it
        self._answers: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Answers to the queue, vLLM's own output to the log; None at the end."""
        for line in self.process.stdout:
            if line.startswith(MARKER):
                self._answers.put(json.loads(line[len(MARKER):]))
            else:
                self._log.write(line)
        self._answers.put(None)

    def _answer(self) -> dict:
        try:
            answer = self._answers.get(timeout=self.timeout_s)
        except queue.Empty:
            raise VllmFailed(f"no answer within {self.timeout_s:.0f} s") from None
        if answer is None:
            raise VllmFailed(self._last_error())
        return answer

    def timed(self, texts: list[str]) -> float:
        """Seconds of one `embed` call of these texts (the benchmark's texts or its
        query), or NaN once the worker has failed."""
        if self.error is not None:
            return float("nan")
        what = "texts" if texts == self.texts else "query" if texts == [self.query] else None
        if what is None:
            raise ValueError("vLLM's worker embeds only the texts and query it started with")
        try:
            self._signal(signal.SIGCONT)
            self.process.stdin.write(what + "\n")
            self.process.stdin.flush()
            seconds = float(self._answer()["seconds"])
            self._signal(signal.SIGSTOP)
            return seconds
        except (VllmFailed, OSError) as exc:
            self._fail(str(exc))
            return float("nan")

    def _signal(self, signum: int) -> None:
        """Stop or continue the worker's whole process group (ProcessLookupError
        is an OSError: a worker gone is a failure, as on any call)."""
        os.killpg(self.process.pid, signum)

    def _fail(self, error: str) -> None:
        self.error = error
        self.close()

    def _last_error(self) -> str:
        """The worker's line that says what went wrong: the last naming an error."""
        self._log.flush()
        lines = [line.strip() for line in self.log_path.read_text(errors="replace").splitlines()
                 if line.strip()]
        named = [line for line in lines if "Error" in line or "error" in line]
        return (named or lines or ["the worker exited without output"])[-1][:500]

    def close(self) -> None:
        """End the worker (ours, by its handle) and drop its files; again is a no-op."""
        if self.process is not None and self.process.poll() is None:
            try:
                self._signal(signal.SIGCONT)
                self.process.stdin.write("quit\n")
                self.process.stdin.flush()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        if self._reader is not None:
            self._reader.join(timeout=10)  # it reads to the end of the worker's output
        if self._log is not None and not self._log.closed:
            self._log.close()
        self._scratch.cleanup()
