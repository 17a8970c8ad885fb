"""An urgent request's time to first token while a batch job fills the engine.

    .venv/bin/python scripts/priority_ttft.py [--streams 64] [--rounds 5]
        [--fcfs-rounds 1] [-- SERVE FLAGS]

BENCHMARK-ONLY. For each policy (priority, then fcfs) it starts `pagedserve
serve --scheduling-policy POLICY` with the given flags, measures an urgent
chat's TTFT on the idle server (priority -1, greedy, streamed), then starts
a batch job of `--streams` low-priority streams (priority 10), each posting
256-token completions one after another, more than --max-num-seqs holds, so
the engine stays full and some always wait. Meanwhile it sends the urgent
chat `--rounds` times (`--fcfs-rounds` under fcfs, where each waits out the
queue), one after the other. It prints the median TTFT idle and under the
batch, their ratio, the fewest requests running and waiting seen before an
urgent one, and whether the urgent answers equal the idle one (greedy: they
must). Under fcfs the requests carry no priority. The prefix cache is reset
before each urgent request, so none is a cache hit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx

URGENT = {"messages": [{"role": "user", "content": "Name three primary colours."}],
          "max_tokens": 24, "temperature": 0, "stream": True}


async def ttft(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, str]:
    """Seconds to the first content chunk, and the whole answer. The prefix cache
    is emptied first, so no measurement gains from an earlier one's blocks."""
    (await client.post(f"{url}/reset_prefix_cache")).raise_for_status()
    start, first, parts = time.perf_counter(), None, []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"]
            text = delta[0]["delta"].get("content") if delta else None
            if text:
                first = first or time.perf_counter() - start
                parts.append(text)
    return first, "".join(parts)


async def batch_worker(client: httpx.AsyncClient, url: str, body: dict,
                       stop: asyncio.Event) -> None:
    """One low-priority stream of the batch job: a completion after another, until
    told to stop, so the engine stays full however long the urgent rounds take."""
    while not stop.is_set():
        (await client.post(f"{url}/v1/completions", json=body)).raise_for_status()


async def measure(url: str, policy: str, streams: int, rounds: int) -> dict:
    urgent = {**URGENT, **({"priority": -1} if policy == "priority" else {})}
    batch_body = {"prompt": "Write a long story about the sea.", "max_tokens": 256,
                  "ignore_eos": True, **({"priority": 10} if policy == "priority" else {})}
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        idle = [await ttft(client, url, urgent) for _ in range(rounds)]
        stop = asyncio.Event()
        batch = [asyncio.create_task(batch_worker(client, url, batch_body, stop))
                 for _ in range(streams)]
        await asyncio.sleep(3)  # the batch is admitted and decoding
        busy, loads = [], []
        for _ in range(rounds):
            loads.append(await engine_load(client, url))
            busy.append(await ttft(client, url, urgent))
        failed = [task for task in batch if task.done() and task.exception()]
        if failed:
            raise SystemExit(f"the batch job failed: {failed[0].exception()!r}")
        stop.set()
        for task in batch:
            task.cancel()
        await asyncio.gather(*batch, return_exceptions=True)
    idle_ttft = statistics.median(t for t, _ in idle)
    busy_ttft = statistics.median(t for t, _ in busy)
    return {"policy": policy, "idle_ttft_s": idle_ttft, "busy_ttft_s": busy_ttft,
            "ratio": busy_ttft / idle_ttft, "busy_ttfts_s": [t for t, _ in busy],
            "running": min(load.get("running", 0) for load in loads),
            "waiting": min(load.get("waiting", 0) for load in loads),
            "answers_equal": all(text == idle[0][1] for _, text in idle + busy)}


async def engine_load(client: httpx.AsyncClient, url: str) -> dict:
    """Running and waiting requests, from /metrics: proof that the batch fills the engine."""
    text = (await client.get(f"{url}/metrics")).text
    load = {}
    for line in text.splitlines():
        for state in ("running", "waiting"):
            if line.startswith(f"pagedserve:num_requests_{state} "):
                load[state] = int(float(line.split()[-1]))
    return load


def serve(policy: str, port: int, flags: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagedserve", "serve", "--port", str(port),
               "--scheduling-policy", policy, *flags]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    for _ in range(600):
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).raise_for_status()
            return server
        except httpx.HTTPError:
            if server.poll() is not None:
                raise SystemExit(f"the server exited: {' '.join(command)}") from None
            time.sleep(0.5)
    raise SystemExit("the server did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fcfs-rounds", type=int, default=1,
                        help="rounds under fcfs, where each urgent request waits out the queue (0: skip it)")
    parser.add_argument("--port", type=int, default=8041)
    parser.add_argument("flags", nargs="*", help="more `pagedserve serve` flags (after --)")
    args = parser.parse_args()
    for offset, policy in enumerate(("priority", "fcfs")):
        rounds = args.rounds if policy == "priority" else args.fcfs_rounds
        if rounds <= 0:
            continue
        port = args.port + offset  # a port of its own: never the previous server's
        server = serve(policy, port, args.flags)
        try:
            row = asyncio.run(measure(f"http://127.0.0.1:{port}", policy, args.streams, rounds))
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)
        print(f"{row['policy']:8s} idle TTFT {row['idle_ttft_s'] * 1000:7.1f} ms   under the "
              f"batch {row['busy_ttft_s'] * 1000:8.1f} ms   ratio {row['ratio']:6.2f}   "
              f"batch at least {row['running']} running, {row['waiting']} waiting   "
              f"answers equal: {row['answers_equal']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
