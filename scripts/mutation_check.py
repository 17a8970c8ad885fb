"""A mutation check, run by hand: plant realistic bugs one at a time, see the tests fail.

Each entry of scripts/mutations.toml is one planted bug over the engine's core,
sampling, spec_decode, pooling, frontend or the service: the file, an exact
snippet of it (it must occur exactly once), its replacement, what bug that is,
and the fast tests that must fail with it (pytest node ids or files). The check
copies the working tree (tracked and untracked files; no .venv, .git, caches or
build outputs) into a temporary folder once, and there, for each mutation,
plants it, runs its tests with this interpreter

    python -m pytest -x -q -p no:cacheprovider <its tests>      (cwd: the copy)

and puts the file back. A mutation is *caught* when its tests fail, *survived*
when they pass, *timeout* past --timeout, *error* when its snippet is not
found once (a stale entry) or its tests cannot be collected as named; only
*caught* counts. The checkout itself is never touched, so it can run while
others work in it (kernels/, which no entry may edit, is linked rather than
copied, so the compiled CPU ops stay one shared build; an overrunning run is
stopped with SIGINT first, so no build lock is left behind).

    .venv/bin/python scripts/mutation_check.py                # all; exit 1 under 90 % caught
    .venv/bin/python scripts/mutation_check.py --list         # the mutations, one a line
    .venv/bin/python scripts/mutation_check.py --check        # each snippet once, clean tests pass
    .venv/bin/python scripts/mutation_check.py --only ID ...  # some of them
    .venv/bin/python scripts/mutation_check.py --jobs 2 --json mutants.json

A whole run with --jobs 2 takes 5-6 minutes on two quiet cores (about 20 on
busy ones), --check about as long (--jobs N runs N mutations at once, each in
a copy of its own). When code moves, --check names the
entries whose snippet no longer matches; when a mutation survives, either a
test is missing (write one that fails for the bug, not for the edit) or the
entry names the wrong tests.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
MUTATIONS = Path(__file__).with_name("mutations.toml")
THRESHOLD = 0.9  # the share of mutations that must be caught
# Never copied: environments, version control, caches and build outputs.
SKIPPED_PARTS = frozenset({".venv", ".git", "__pycache__", ".pytest_cache", ".hypothesis",
                           "build", "dist", "node_modules"})
# Linked, not copied: kernels/. The compiled CPU ops are built into a cache shared
# by every checkout and keyed by their sources' resolved path (kernels/cpu/ops.py);
# from a copy elsewhere, each test process would rebuild them there, under the
# feet of whoever uses them. No mutation edits kernels/.
LINKED = ("kernels",)
# pytest's exit code for "the tests ran and passed", and those that mean the entry
# is at fault (a node id not found, nothing collected); any other code is a failure.
PASSED = 0
RUN_ERRORS = {4: "usage error (a test not found?)", 5: "no tests collected"}
STOP_GRACE_SECONDS = 60  # an overrunning run's time to clean up after SIGINT


@dataclass(frozen=True)
class Mutation:
    id: str
    file: str
    original: str
    replacement: str
    bug: str
    tests: tuple[str, ...]


@dataclass
class Result:
    id: str
    file: str
    status: str  # caught | survived | timeout | error
    seconds: float
    detail: str = ""  # the failing test or the error, one line


def load(path: Path = MUTATIONS) -> list[Mutation]:
    """The mutations of the data file, checked for complete and unique entries."""
    entries = tomllib.loads(path.read_text())["mutation"]
    mutations, seen = [], set()
    for entry in entries:
        missing = {"id", "file", "original", "replacement", "bug", "tests"} - set(entry)
        if missing:
            raise SystemExit(f"{path.name}: {entry.get('id', entry)} lacks {sorted(missing)}")
        if entry["id"] in seen:
            raise SystemExit(f"{path.name}: id {entry['id']!r} twice")
        if entry["original"] == entry["replacement"] or not entry["tests"]:
            raise SystemExit(f"{path.name}: {entry['id']} changes nothing or names no test")
        if any(Path(entry["file"]).is_relative_to(link) for link in LINKED):
            raise SystemExit(f"{path.name}: {entry['id']} edits {entry['file']}, which the "
                             f"copies link to the checkout itself")
        seen.add(entry["id"])
        mutations.append(Mutation(entry["id"], entry["file"], entry["original"],
                                  entry["replacement"], entry["bug"], tuple(entry["tests"])))
    return mutations


def snippet_problem(tree: Path, mutation: Mutation) -> str | None:
    """Why the mutation cannot be planted in `tree` (None: its snippet occurs once)."""
    path = tree / mutation.file
    if not path.is_file():
        return f"{mutation.file} does not exist"
    count = path.read_text().count(mutation.original)
    return None if count == 1 else f"the snippet occurs {count} times in {mutation.file}"


def tree_files(root: Path) -> list[str]:
    """The working tree's files as git sees them: tracked and untracked, not ignored."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=root, capture_output=True, check=True).stdout.decode()
    return sorted({name for name in listed.split("\0") if name
                   and not SKIPPED_PARTS.intersection(Path(name).parts)
                   and not any(name == link or name.startswith(link + "/") for link in LINKED)
                   and (root / name).is_file()})


def copy_tree(root: Path, destination: Path) -> Path:
    """A copy of the working tree under `destination`, ready to mutate and test."""
    for name in tree_files(root):
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)
    for link in LINKED:
        if (root / link).exists():
            (destination / link).parent.mkdir(parents=True, exist_ok=True)
            (destination / link).symlink_to(root / link)
    found = subprocess.run([sys.executable, "-c", "import engine; print(engine.__file__)"],
                           cwd=destination, env=test_env(destination), capture_output=True,
                           text=True, check=True).stdout.strip()
    if not Path(found).resolve().is_relative_to(destination.resolve()):
        raise SystemExit(f"the copy imports the engine from {found}, not from itself")
    return destination


def test_env(tree: Path) -> dict[str, str]:
    """The tests' environment: the copy first on the path (also for processes the
    tests start), and no bytecode written, so that no stale .pyc of a mutated file
    with the same size and second can be read back."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", COLUMNS="240")  # whole summary lines
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    return env


def run_tests(tree: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """(passed | failed | timeout | error, seconds, a line saying what failed)."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    with subprocess.Popen(command, cwd=tree, env=test_env(tree), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True) as run:
        try:
            output, _ = run.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(run)
            return "timeout", time.monotonic() - start, f"over {timeout:g} s"
        except KeyboardInterrupt:  # ^C: the run is in a session of its own, end it too
            stop(run)
            raise
    seconds = time.monotonic() - start
    if run.returncode == PASSED:
        return "passed", seconds, ""
    if run.returncode in RUN_ERRORS:
        return "error", seconds, RUN_ERRORS[run.returncode] + ": " + last_line(output)
    return "failed", seconds, first_failure(output) or last_line(output)


def stop(run: subprocess.Popen) -> None:
    """End a test run that overran, and whatever it started: first with SIGINT, so
    that `finally` blocks run (a compile of the CPU ops holds a lock file in the
    shared build cache until its `finally`; killed outright, it would leave the
    lock behind and every later load would wait on it), then with SIGKILL."""
    os.killpg(run.pid, signal.SIGINT)
    try:
        run.communicate(timeout=STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        run.communicate()


def first_failure(output: str) -> str:
    """The first FAILED or ERROR line of pytest's short summary, without its prefix
    (captured log lines above the summary may start with ERROR too)."""
    summary = output.rpartition("short test summary info")[2]
    for line in summary.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1][:200]
    return ""


def last_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


def check_mutation(tree: Path, mutation: Mutation, timeout: float) -> Result:
    """Plant one mutation in `tree`, run its tests, put the file back."""
    problem = snippet_problem(tree, mutation)
    if problem is not None:
        return Result(mutation.id, mutation.file, "error", 0.0, problem)
    path = tree / mutation.file
    original = path.read_text()
    try:
        path.write_text(original.replace(mutation.original, mutation.replacement))
        outcome, seconds, detail = run_tests(tree, mutation.tests, timeout)
    finally:
        path.write_text(original)
    status = {"failed": "caught", "passed": "survived"}.get(outcome, outcome)
    return Result(mutation.id, mutation.file, status, seconds, detail)


def run_all(mutations: list[Mutation], trees: list[Path], timeout: float) -> list[Result]:
    """Every mutation, len(trees) at a time, each worker in a tree of its own."""
    free: queue.Queue[Path] = queue.Queue()
    for tree in trees:
        free.put(tree)

    def one(mutation: Mutation) -> Result:
        tree = free.get()
        try:
            return check_mutation(tree, mutation, timeout)
        finally:
            free.put(tree)

    results = {}
    # One job runs in this thread, where ^C lands and stops its test run.
    with ThreadPoolExecutor(len(trees)) as pool, tqdm(total=len(mutations), unit="mutant") as bar:
        for result in (pool.map if len(trees) > 1 else map)(one, mutations):
            results[result.id] = result
            caught = sum(r.status == "caught" for r in results.values())
            bar.set_postfix_str(f"{result.id}: {result.status}; caught {caught}/{len(results)}")
            bar.update()
    return [results[m.id] for m in mutations]


def check_clean(mutations: list[Mutation], tree: Path, timeout: float) -> list[Result]:
    """--check: every snippet once in the checkout, and each distinct test set
    passing on the unmutated copy."""
    results = [Result(m.id, m.file, "error", 0.0, problem) for m in mutations
               if (problem := snippet_problem(ROOT, m)) is not None]
    test_sets = list(dict.fromkeys(m.tests for m in mutations))
    for tests in tqdm(test_sets, unit="test set"):
        outcome, seconds, detail = run_tests(tree, tests, timeout)
        users = ", ".join(m.id for m in mutations if m.tests == tests)
        status = "ok" if outcome == "passed" else outcome
        results.append(Result(users, " ".join(tests), status, seconds, detail))
    return results


def print_table(results: list[Result]) -> None:
    width = max((len(r.id) for r in results), default=2)
    print(f"\n{'id':<{width}}  {'status':<8}  {'seconds':>7}  detail")
    for r in results:
        print(f"{r.id:<{width}}  {r.status:<8}  {r.seconds:7.1f}  {r.detail}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--only", nargs="+", metavar="ID", help="run only these mutations")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--check", action="store_true",
                        help="check the list: snippets found once, clean tests pass")
    parser.add_argument("--jobs", type=int, default=1, help="mutations run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds one mutation's tests may take (default 300)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the results here")
    parser.add_argument("--mutations", type=Path, default=MUTATIONS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def chosen(args: argparse.Namespace) -> list[Mutation]:
    mutations = load(args.mutations)
    if args.only:
        unknown = sorted(set(args.only) - {m.id for m in mutations})
        if unknown:
            raise SystemExit(f"no mutation named {unknown}")
        mutations = [m for m in mutations if m.id in args.only]
    return mutations


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mutations = chosen(args)
    if args.list:
        for m in mutations:
            print(f"{m.id:<28} {m.file:<40} {m.bug}")
        return 0
    with tempfile.TemporaryDirectory(prefix="pagedserve-mutants-") as scratch:
        jobs = 1 if args.check else max(1, min(args.jobs, len(mutations)))
        trees = [copy_tree(ROOT, Path(scratch) / f"tree{i}") for i in range(jobs)]
        if args.check:
            results = check_clean(mutations, trees[0], args.timeout)
        else:
            results = run_all(mutations, trees, args.timeout)
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    if args.check:
        bad = [r for r in results if r.status != "ok"]
        print(f"\n{len(mutations)} mutations, {len(results) - len(bad)} checks ok, {len(bad)} not")
        return 1 if bad else 0
    caught = sum(r.status == "caught" for r in results)
    share = caught / len(results) if results else 0.0
    print(f"\ncaught {caught}/{len(results)} = {share:.0%} (needed: {THRESHOLD:.0%})")
    return 0 if share >= THRESHOLD else 1


if __name__ == "__main__":
    sys.exit(main())
