"""Many streaming requests at once: each one's output is the output it gets alone.

Continuous batching mixes requests that arrive together into one batch, and
their prefills and decodes interleave. Greedy decoding must not notice: every
streamed text is compared with the same request run alone afterwards, and so
are the logprobs of every token.

One thing batching may change is float rounding (a different batch shape, a
prompt block read from the prefix cache instead of recomputed): about 1e-5 in
a logprob. Where the top two candidates are closer than that, greedy may pick
either, so, as vLLM's `check_logprobs_close` does, a divergence is accepted
only at a near-tie: both tokens among the other run's top candidates with
logprobs within TIE of each other (the tiny model has one such token, a gap
of 6e-6, among its 64 x 24). Before that point the logprobs must agree. A real
mix-up (wrong KV block, a stream delivered to the wrong client) moves them by
far more than that.

When everything has finished, no request is left running and every KV block
is free again (cached blocks count as free: they are evictable).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from live_server import LiveServer, is_error_event, wait_until
from service.serving.admitted import merge

SUBJECTS = [
    "the sea", "a mountain", "an old library", "the moon", "a train station", "bread",
    "a violin", "winter", "a lighthouse", "the desert", "a garden", "rain", "a clock",
    "the city at night", "a river", "bees",
]
STYLES = ["Describe", "Write a haiku about", "Tell a short story about", "List facts about"]
TOP = 2  # top logprobs per token
TIE = 1e-4  # a near-tie: two candidates this close may swap under different rounding
CLOSE = 1e-3  # how far batching may move a logprob


# On a busy 2-core machine two OpenMP threads make small ops wait on each other.
pytestmark = pytest.mark.usefixtures("single_thread")


@dataclass(frozen=True)
class Job:
    """One request: chat for even indices, text completions for odd ones."""

    index: int
    text: str

    @property
    def is_chat(self) -> bool:
        return self.index % 2 == 0


def make_jobs(count: int) -> list[Job]:
    jobs = []
    for i in range(count):
        subject = SUBJECTS[i % len(SUBJECTS)]
        style = STYLES[(i // len(SUBJECTS)) % len(STYLES)]
        # Different lengths too, so prefills of different sizes share steps.
        jobs.append(Job(i, f"{style} {subject}." + " Please be detailed." * (i % 5)))
    assert len({job.text for job in jobs}) == count
    return jobs


@dataclass
class Result:
    text: str
    finish_reason: str | None
    completion_tokens: int
    tokens: list[str]
    logprobs: list[float]
    tops: list[dict[str, float]]  # per token: candidate -> logprob


async def run_stream(client: openai.AsyncOpenAI, model: str, job: Job, max_tokens: int) -> Result:
    common = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    if job.is_chat:
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": job.text}], logprobs=True, top_logprobs=TOP,
            **common,
        )
    else:
        stream = await client.completions.create(prompt=job.text, logprobs=TOP, **common)
    text, finish, usage = "", None, None
    tokens, logprobs, tops = [], [], []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index == 0
            assert finish is None, "a chunk after finish_reason"
            finish = choice.finish_reason or finish
            if job.is_chat:
                text += choice.delta.content or ""
                for entry in (choice.logprobs.content if choice.logprobs else None) or []:
                    tokens.append(entry.token)
                    logprobs.append(entry.logprob)
                    tops.append({t.token: t.logprob for t in entry.top_logprobs})
            else:
                text += choice.text
                if choice.logprobs is not None:
                    tokens += choice.logprobs.tokens
                    logprobs += choice.logprobs.token_logprobs
                    tops += choice.logprobs.top_logprobs
    assert usage is not None, "include_usage gives a final usage chunk"
    assert len(tokens) == len(logprobs) == len(tops) == usage.completion_tokens
    return Result(text, finish, usage.completion_tokens, tokens, logprobs, tops)


async def run_all(live: LiveServer, model: str, jobs: list[Job], max_tokens: int):
    """Every job at once (recording the largest running batch), then each alone."""
    running = []

    async def watch(stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as http:
            while not stop.is_set():
                text = (await http.get("/metrics")).text
                for line in text.splitlines():
                    if line.startswith("pagedserve:num_requests_running "):
                        running.append(float(line.split()[-1]))
                await asyncio.sleep(0.02)

    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                                timeout=300)
    async with client:
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        try:
            together = await asyncio.gather(
                *(run_stream(client, model, job, max_tokens) for job in jobs)
            )
        finally:
            stop.set()
            await watcher
        alone = [await run_stream(client, model, job, max_tokens) for job in jobs]
    return together, alone, max(running, default=0)


def near_tie(run: Result, position: int, other_token: str) -> bool:
    """Was `other_token` within TIE of the token `run` chose at `position`?"""
    candidates = run.tops[position]
    return (other_token in candidates
            and abs(candidates[other_token] - run.logprobs[position]) < TIE)


def compare(job: Job, concurrent: Result, single: Result) -> bool:
    """Assert the two runs of `job` agree; True if they parted at a near-tie."""
    where = f"request {job.index} ({job.text!r})"
    split = next((k for k, (a, b) in enumerate(zip(concurrent.tokens, single.tokens))
                  if a != b), None)
    for k in range(len(concurrent.tokens) if split is None else split):
        assert abs(concurrent.logprobs[k] - single.logprobs[k]) < CLOSE, (
            f"{where}: token {k} has logprob {concurrent.logprobs[k]} in the batch, "
            f"{single.logprobs[k]} alone"
        )
    if split is None:
        assert concurrent.text == single.text, f"{where}: same tokens, different text"
        return False
    a, b = concurrent.tokens[split], single.tokens[split]
    assert near_tie(concurrent, split, b) and near_tie(single, split, a), (
        f"{where}: token {split} is {a!r} in the batch but {b!r} alone, and that is no "
        f"near-tie: batch top {concurrent.tops[split]}, alone top {single.tops[split]}"
    )
    return True


def check(live: LiveServer, together, alone, max_running, jobs, max_tokens: int) -> None:
    assert len(together) == len(alone) == len(jobs)
    ties = 0
    for job, concurrent, single in zip(jobs, together, alone):
        assert concurrent.finish_reason == single.finish_reason == "length", job
        assert concurrent.completion_tokens == single.completion_tokens == max_tokens, job
        ties += compare(job, concurrent, single)
    # Near-ties are rare; many of them would mean the rounding drifts too far.
    assert ties <= max(1, len(jobs) // 16)
    # Different prompts give different outputs (a server mixing streams up would
    # be caught by the comparison above; this guards against a degenerate model).
    assert len({result.text for result in together}) > len(jobs) // 2
    # The requests really did share batches.
    assert max_running >= 2

    def idle() -> bool:
        metrics = live.metrics()
        return (metrics["pagedserve:num_requests_running"] == 0
                and metrics["pagedserve:num_requests_waiting"] == 0
                and metrics["pagedserve:kv_blocks_free"] == metrics["pagedserve:kv_blocks_total"])

    assert wait_until(idle, timeout=5), live.metrics()


def test_64_concurrent_streams_on_tiny_model(tiny_server):
    jobs = make_jobs(64)
    max_tokens = 24
    together, alone, max_running = asyncio.run(run_all(tiny_server, "tiny", jobs, max_tokens))
    check(tiny_server, together, alone, max_running, jobs, max_tokens)


def test_16_concurrent_streams_on_smollm2(smollm2_server):
    jobs = make_jobs(16)
    max_tokens = 16
    together, alone, max_running = asyncio.run(
        run_all(smollm2_server, "smollm2-135m-instruct", jobs, max_tokens)
    )
    check(smollm2_server, together, alone, max_running, jobs, max_tokens)


# -- a batched stream the client drops ------------------------------------------------
def server_tasks(live: LiveServer) -> int:
    """How many asyncio tasks the server's event loop holds (this count included)."""
    async def count() -> int:
        return len(asyncio.all_tasks())

    return asyncio.run_coroutine_threadsafe(count(), live.state.engine._loop).result(timeout=10)


def settled_tasks(live: LiveServer, quiet: float = 0.3, timeout: float = 10) -> int:
    """server_tasks() once it has held still for `quiet` seconds: uvicorn ends a
    connection's task a moment after the response, not with it."""
    deadline = time.monotonic() + timeout
    count, since = server_tasks(live), time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, "the server's tasks never settled"
        time.sleep(0.02)
        now = server_tasks(live)
        if now != count:
            count, since = now, time.monotonic()
    return count


def test_a_dropped_batched_stream_leaves_no_task_behind(tiny_server):
    # A batch of prompts streams through merge(), one reader task per prompt.
    # The reader of a dropped stream would wait forever on a request that was
    # aborted, so merge() must end them: count the loop's tasks to see it.
    live = tiny_server
    prompts = [[5, 6, i] for i in range(4)]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 240, "ignore_eos": True,
            "stream": True}
    with live.client() as client:
        # sse-starlette starts one shutdown watcher task on the loop's first
        # stream, for good: have it running before counting.
        warm_up = client.post("/v1/completions", json={**body, "prompt": "hi", "max_tokens": 1})
        assert warm_up.status_code == 200, warm_up.text
    before = settled_tasks(live)
    with live.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()
        events = 0
        while events < 8:  # a few chunks, then walk away
            line = next(lines)
            events += line.startswith("data: ")
            assert "[DONE]" not in line and not is_error_event(line), line
        running = live.state.engine.stats.counters["num_requests_running"]
        during = server_tasks(live)
    assert running == len(prompts), running  # dropped mid-generation, not after the end
    assert during >= before + len(prompts), (before, during)  # the readers are counted

    def idle() -> bool:
        counters = live.state.engine.stats.counters
        return counters["num_requests_running"] == 0 and counters["num_requests_waiting"] == 0

    assert wait_until(idle, timeout=10), live.state.engine.stats.counters
    assert wait_until(lambda: server_tasks(live) == before, timeout=5), (before, server_tasks(live))


async def endless(item):
    """One item, then nothing ever again: a released request's stream."""
    yield item
    await asyncio.Event().wait()


def test_closing_a_merge_cancels_its_readers():
    # A dropped client usually cancels the response's task, and a cancelled
    # gather() takes the readers with it. A merge can also be closed without
    # any cancellation: sse-starlette aclose()s a body whose send failed, and
    # Python aclose()s an abandoned async generator. Then only merge() itself
    # can end readers that would otherwise wait forever.
    async def scenario() -> None:
        merged = merge([endless(i) for i in range(3)])
        assert (await anext(merged))[1] in range(3)
        readers = asyncio.all_tasks() - {asyncio.current_task()}
        assert len(readers) == 3
        try:
            await asyncio.wait_for(merged.aclose(), timeout=5)
        except TimeoutError:
            pytest.fail("closing the merge waits on readers that nothing cancelled")
        assert all(task.done() for task in readers)

    asyncio.run(scenario())
