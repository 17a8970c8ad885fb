"""`pagedserve bench hostile`: does a heavy request hold up the others?

    pagedserve bench hostile [--kind schema|pattern|tools] [--in-flight 4] [--pause 0]
                             [--rounds 3] [--phase-seconds 20] [--output r.json]
                             [--url URL | -- flags for `pagedserve serve`]

One server (started here with the flags after `--`, or the one at --url)
runs --streams long completions streams throughout. Phases alternate:

    idle      nothing else
    hostile   --in-flight hostile chat requests kept open all the time, each
              replaced as soon as it is answered:
                schema   the costliest JSON schema the grammar checks let through
                         (engine/sampling/grammar_checks.py): six strings, each
                         its own maxLength from 150 up (~3 s of compile on the
                         2-core CPU); a new set of bounds each time, so no
                         compile is a cache hit
                pattern  issue 38's: two strings with pattern ^[a-z]{1,N}$, N
                         from --repeat up: tens of seconds of compile unpriced,
                         refused at once since grammar_checks.py prices it
                tools    3,000 tools (620 KB) with tool_choice "required"

The hostile requests come from a process of their own, so that sending them
never holds up the client that times the rest. In every phase a plain chat
(16 tokens, ignore_eos, not streamed) is sent again and again, one at a
time. Reported for each kind of phase: the plain chat's median latency and
the streams' median gap between tokens, the ratios hostile / idle (the bar:
2x and 1.5x), pooled and as the median of each round's own ratio (robust to
other load on the machine coming and going), and what the hostile requests
got. Hostile requests still open when their phase ends are dropped by the
client (the server drops their queued preparation); an idle phase after a
hostile one may still find an abandoned compile running on the server.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.common.replicas import Replica
from bench.common.report import print_table, write_json

CHAT = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}
PLAIN = {"messages": [{"role": "user", "content": "Say something kind about the sea."}],
         "max_tokens": 16, "ignore_eos": True, "temperature": 0}
STREAM = {"prompt": "Once upon a time", "ignore_eos": True, "stream": True, "temperature": 0}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve bench hostile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=("schema", "pattern", "tools"), default="schema")
    parser.add_argument("--in-flight", type=int, default=4, help="hostile requests open at once")
    parser.add_argument("--pause", type=float, default=0.0,
                        help="seconds a hostile client waits after each answer (0: none, "
                             "which for requests refused at once is a flood)")
    parser.add_argument("--streams", type=int, default=2, help="long streams running throughout")
    parser.add_argument("--stream-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3, help="idle + hostile phase pairs")
    parser.add_argument("--phase-seconds", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=20000,
                        help="pattern: the repetition bound (compile time grows with it)")
    parser.add_argument("--url", default=None, help="a running server (else one is started)")
    parser.add_argument("--output", default=None, help="write the results as JSON")
    parser.add_argument("serve_flags", nargs="*", help="after --: flags for pagedserve serve")
    return parser


def hostile_body(kind: str, number: int, repeat: int) -> bytes:
    """The JSON body of hostile request `number`. 3,000 tools are the same each time,
    encoded once: encoding them again for every request took the client's loop
    from the streams it times."""
    if kind == "tools":
        return _TOOLS_BODY
    return json.dumps(_hostile_request(kind, number, repeat)).encode()


def _hostile_request(kind: str, number: int, repeat: int) -> dict:
    ask = [{"role": "user", "content": "Fill in the form."}]
    if kind in ("schema", "pattern"):
        if kind == "schema":
            strings = [{"type": "string", "maxLength": 150 + 6 * number + i} for i in range(6)]
        else:
            strings = [{"type": "string", "pattern": f"^[a-z]{{1,{repeat + number}}}$"}] * 2
        names = [f"field_{i}" for i in range(len(strings))]
        schema = {"type": "object", "properties": dict(zip(names, strings)), "required": names}
        return {"messages": ask, "max_tokens": 16, "response_format": {
            "type": "json_schema", "json_schema": {"name": "form", "schema": schema}}}
    tools = [{"type": "function", "function": {
        "name": f"lookup_{i}",
        "description": "Looks up one catalogue entry.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                       "required": ["name"]}}}
        for i in range(3000)]
    return {"messages": ask, "max_tokens": 16, "tools": tools, "tool_choice": "required"}


_TOOLS_BODY = json.dumps(_hostile_request("tools", 0, 0)).encode()


@dataclass
class Phase:
    kind: str  # "idle" or "hostile"
    chat_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    hostile: list[tuple[str, float]] = field(default_factory=list)  # (status, seconds)


async def stream_forever(http: httpx.AsyncClient, tokens: int,
                         gaps: list[tuple[float, float]]) -> None:
    """One long stream after another; each gap between chunks as (arrival, gap)."""
    while True:
        async with http.stream("POST", "/v1/completions",
                               json={**STREAM, "max_tokens": tokens}) as response:
            last = None
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append((now, now - last))
                last = now


def hostile_process(url: str, args: argparse.Namespace, first: int,
                    outcomes: multiprocessing.Queue, stop) -> None:
    """Keep `in_flight` hostile requests open until `stop` is set, then drop them
    (their connections close); each answer's (status, seconds) goes to `outcomes`.
    A process of its own, so that sending (and encoding) them never holds up the
    client that times the others."""
    numbers = itertools.count(first)

    async def keep(http: httpx.AsyncClient) -> None:
        while True:
            body = hostile_body(args.kind, next(numbers), args.repeat)
            started = time.perf_counter()
            try:
                status = str((await http.post(CHAT, content=body, headers=JSON)).status_code)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            outcomes.put((status, time.perf_counter() - started))
            await asyncio.sleep(args.pause)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            workers = [asyncio.create_task(keep(http)) for _ in range(args.in_flight)]
            while not stop.is_set():
                await asyncio.sleep(0.05)
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    asyncio.run(run())


async def run_phase(http: httpx.AsyncClient, args, hostile: bool, first: int,
                    gaps: list[tuple[float, float]]) -> Phase:
    phase = Phase("hostile" if hostile else "idle")
    context = multiprocessing.get_context("spawn")
    outcomes, stop = context.Queue(), context.Event()
    sender = context.Process(target=hostile_process, daemon=True,
                             args=(str(http.base_url), args, first, outcomes, stop))
    if hostile:
        sender.start()
    try:
        await asyncio.sleep(3.0)  # the hostile requests are in flight; the streams run
        start = time.perf_counter()
        while time.perf_counter() - start < args.phase_seconds:
            sent = time.perf_counter()
            response = await http.post(CHAT, json=PLAIN)
            response.raise_for_status()
            phase.chat_s.append(time.perf_counter() - sent)
            await asyncio.sleep(0.2)
        end = time.perf_counter()
    finally:
        if hostile:  # its connections close: the server sees its clients leave
            stop.set()
            while sender.is_alive() or not outcomes.empty():
                while not outcomes.empty():
                    phase.hostile.append(outcomes.get())
                await asyncio.sleep(0.05)
    phase.gaps_s = [gap for at, gap in gaps if start <= at <= end]
    return phase


async def measure(url: str, args) -> list[Phase]:
    limits = httpx.Limits(max_connections=args.in_flight + args.streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await http.post(CHAT, json=PLAIN)  # warm: the chat template, the first step
        gaps: list[tuple[float, float]] = []
        streams = [asyncio.create_task(stream_forever(http, args.stream_tokens, gaps))
                   for _ in range(args.streams)]
        phases = []
        try:
            for _ in range(args.rounds):
                for hostile in (False, True):  # new schemas each phase: no cache hits
                    phases.append(await run_phase(http, args, hostile, len(phases) << 20, gaps))
                    print(_phase_line(phases[-1]), flush=True)
        finally:
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    return phases


def _phase_line(phase: Phase) -> str:
    line = (f"{phase.kind:8} plain chat median {_ms(phase.chat_s)} ms ({len(phase.chat_s)}), "
            f"token gap median {_ms(phase.gaps_s)} ms ({len(phase.gaps_s)})")
    if phase.kind == "hostile":
        line += f", hostile answered: {dict(Counter(s for s, _ in phase.hostile))}"
    return line


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f}" if values else "-"


def summarize(phases: list[Phase], args) -> dict:
    def pooled(kind: str, name: str) -> list[float]:
        return [v for p in phases if p.kind == kind for v in getattr(p, name)]

    summary = {}
    for name in ("chat_s", "gaps_s"):
        idle, hostile = pooled("idle", name), pooled("hostile", name)
        # Each round's hostile phase against the idle one just before it: a
        # machine whose other load comes and goes shifts both alike.
        rounds = [statistics.median(getattr(h, name)) / statistics.median(getattr(i, name))
                  for i, h in zip(phases[::2], phases[1::2])
                  if getattr(i, name) and getattr(h, name)]
        summary[name] = {"idle_median": statistics.median(idle),
                         "hostile_median": statistics.median(hostile),
                         "ratio": statistics.median(hostile) / statistics.median(idle),
                         "round_ratios": rounds,
                         "round_ratio_median": statistics.median(rounds)}
    answered = [outcome for p in phases for outcome in p.hostile]
    return {"kind": args.kind, "in_flight": args.in_flight, "pause": args.pause,
            "streams": args.streams,
            "rounds": args.rounds, "phase_seconds": args.phase_seconds,
            "repeat": args.repeat if args.kind == "pattern" else None, **summary,
            "hostile_answers": dict(Counter(status for status, _ in answered)),
            "hostile_answer_s_median": (statistics.median(s for _, s in answered)
                                        if answered else None),
            "phases": [asdict(p) for p in phases]}


def print_report(report: dict) -> None:
    rows = []
    for label, name, bar in (("plain chat, 16 tokens (ms)", "chat_s", "2x"),
                             ("stream token gap (ms)", "gaps_s", "1.5x")):
        numbers = report[name]
        rows.append([label, f"{numbers['idle_median'] * 1e3:.1f}",
                     f"{numbers['hostile_median'] * 1e3:.1f}", f"{numbers['ratio']:.2f}x",
                     f"{numbers['round_ratio_median']:.2f}x", bar])
    title = (f"{report['in_flight']} hostile {report['kind']} requests in flight (pause "
             f"{report['pause']:g} s), {report['streams']} streams, medians; hostile answers "
             f"{report['hostile_answers']}")
    print_table(["", "idle", "hostile", "ratio", "per round", "bar"], rows, title=title)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.url is not None:
        phases = asyncio.run(measure(args.url, args))
    else:
        with tempfile.TemporaryDirectory(prefix="pagedserve-hostile-") as folder:
            server = Replica.start(args.serve_flags, Path(folder), "server")
            try:
                server.wait_ready()
                phases = asyncio.run(measure(server.url, args))
            except BaseException:
                print(server.log.read_text()[-4000:], file=sys.stderr)
                raise
            finally:
                server.stop()
    report = summarize(phases, args)
    print_report(report)
    if args.output:
        write_json(Path(args.output), report)
    return 0
