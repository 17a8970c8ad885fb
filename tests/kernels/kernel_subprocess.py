"""Running kernel cases in child processes (kernel_case_runner.py).

A Triton interpreter bug can segfault the process; running cases in
children turns that into a failure of the case that was running.  Each child
takes a whole batch (interpreter start-up is ~2-3 s), prints one result line
per finished case, and a crash restarts a child on the cases after the
culprit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kernel_cases import estimated_cost

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
RUNNER = HERE / "kernel_case_runner.py"
RESULT_PREFIX = "@@RESULT "
CHILD_TIMEOUT_S = 600  # below pytest-timeout (900 s), so the hang is blamed on its batch


def run_in_children(batches: list, device: str) -> dict:
    """{case id: None or error} for all batches, one child per batch at a time."""
    results: dict = {}
    with ThreadPoolExecutor(max(1, len(batches))) as pool:
        for batch_result in pool.map(lambda batch: run_batch(batch, device), batches):
            results.update(batch_result)
    return results


def balanced_batches(jobs: list, workers: int) -> list:
    """One batch per worker, greedy by estimated cost (largest first into the
    lightest batch), so the children finish at about the same time.

    Ahead-of-time compile cases form a batch of their own: they need Triton
    in compiled mode, the others (on CPU) the interpreter, and the mode is
    per process.
    """
    compiles = [job for job in jobs if job["case"]["kernel"] == "compile"]
    batches = [[] for _ in range(workers)]
    loads = [0.0] * workers
    others = [job for job in jobs if job["case"]["kernel"] != "compile"]
    for job in sorted(others, key=lambda job: -estimated_cost(job["case"])):
        lightest = loads.index(min(loads))
        batches[lightest].append(job)
        loads[lightest] += estimated_cost(job["case"])
    return [batch for batch in batches + [compiles] if batch]


def run_batch(jobs: list, device: str) -> dict:
    """Run jobs in child processes; a crash blames the case it was running."""
    results: dict = {}
    pending = list(jobs)
    while pending:
        request = json.dumps({"device": device, "cases": pending})
        try:
            proc = subprocess.run([sys.executable, str(RUNNER)], input=request, capture_output=True,
                                  text=True, cwd=REPO_ROOT, timeout=CHILD_TIMEOUT_S)
            stdout, returncode, stderr = proc.stdout, proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            stdout, returncode, stderr = _text(exc.stdout), "timeout", _text(exc.stderr)
        for line in stdout.splitlines():
            if line.startswith(RESULT_PREFIX):
                reported = json.loads(line[len(RESULT_PREFIX):])
                results[reported["id"]] = reported["error"]
        pending = [job for job in pending if job["case"]["id"] not in results]
        if pending:
            culprit = pending.pop(0)
            results[culprit["case"]["id"]] = (
                f"runner process died (exit {returncode}) while running this case; "
                f"stderr tail:\n{stderr[-2000:]}")
    return results


def _text(data) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def main(argv: list[str] | None = None) -> int:
    """Run every Triton case without pytest (machines that lack it), e.g.

        python tests/kernels/kernel_subprocess.py --device cuda --output cases.json
    """
    import argparse
    import os
    import random

    from kernel_cases import all_cases, case_seed

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, help="session seed (default: random)")
    parser.add_argument("--output", type=Path, help="write {case id: error or null} as JSON")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    jobs = [{"case": case, "seed": case_seed(seed, case["id"])} for case in all_cases()]
    workers = 1 if args.device == "cuda" else max(1, len(os.sched_getaffinity(0)))
    results = run_in_children(balanced_batches(jobs, workers), args.device)
    failed = {case_id: error for case_id, error in results.items() if error is not None}
    for case_id, error in sorted(failed.items()):
        print(f"FAILED {case_id}: {error}")
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed (device {args.device}, seed {seed})")
    if args.output:
        args.output.write_text(json.dumps({"seed": seed, "device": args.device, "results": results}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())


def child_env() -> dict:
    """The children's environment: the repo and tests/kernels first on the path,
    then whatever the parent had there (a package carried onto a GPU box, say)."""
    path = [str(REPO_ROOT), str(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def run_cases_script(script: Path, device: str, cases: list, prefix: str):
    """({case id: None or error}, the finished child) of a cases script
    (moe_cases.py, quant_cases.py) run once on `cases`: it reads them as JSON
    on stdin and prints a `prefix` line of JSON per case it finished."""
    proc = subprocess.run(
        [sys.executable, str(script), device], input=json.dumps(cases), cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
        env=child_env())
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith(prefix):
            result = json.loads(line[len(prefix):])
            results[result["id"]] = result["error"]
    return results, proc


def serve_cases(device: str, prefix: str, run, job_id=lambda job: job["id"]) -> None:
    """The child side of run_cases_script, for every cases script: Triton's
    interpreter on for "cpu" (set before anything imports triton) and off
    otherwise (cuda, or sm90: interpreted @jit functions cannot be compiled);
    the jobs read as JSON from stdin, and for each a `prefix` line of JSON
    {"id", "error"}: None, the error `run(job)` returned, or its exception."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    for job in json.load(sys.stdin):
        try:
            error = run(job)
        except Exception:  # noqa: BLE001 - reported as the case's failure
            error = traceback.format_exc()
        print(prefix + json.dumps({"id": job_id(job), "error": error}), flush=True)
