"""The folder tree is the architecture: these tests keep it so.

- Layers point down: pagedserve (the command) -> service -> engine -> kernels;
  bench may use everything below the command. Checked on every import
  statement, including those inside functions.
- Inside engine/ the rooms point down too: frontend/ -> core/, sampling/,
  model/ -> the shared top-level files (config, sampling_params, outputs,
  errors, args). core/ and sampling/ import no other room; model/ reads the
  scheduler's decision only through core/sched_output.py.
- Inside service/ the rooms point down too: routes/ never import one another;
  serving/, responses/, tool_calls/, guards/, protocol/ and fleet/ never import
  routes/, app or cli; protocol/ imports no other room (errors at most).
- Every file reads in one sitting: no source file over 400 lines, no function
  over 60.
- The `pagedserve` dispatcher hands each command line to the right module.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import pytest

from pagedserve.cli import BENCHMARKS, COMMANDS, main, resolve

ROOT = Path(__file__).resolve().parents[1]
ROOM = ROOT / "engine"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60

# What each package may import from the project's other packages.
MAY_IMPORT = MappingProxyType({
    "kernels": frozenset(),
    "engine": frozenset({"kernels"}),
    "service": frozenset({"engine", "kernels"}),
    "bench": frozenset({"engine", "kernels", "service", "clients"}),  # streams through the client
    "clients": frozenset(),  # the client speaks HTTP; it installs without the server
    "pagedserve": frozenset({"engine", "kernels", "service", "bench", "clients"}),
})
# Folders that hold no project source (virtualenvs and dot-folders are skipped too).
NOT_SOURCE = frozenset({"tests", "build", "dist", "node_modules", "__pycache__"})


def python_files(folder: Path):
    for path in sorted(folder.rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path


def imported_modules(path: Path):
    """(line, module) of every absolute import in the file, at any depth."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        # A relative import (level > 0) stays inside its own package.


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_layers_point_down(package):
    others = set(MAY_IMPORT) - {package}
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in python_files(ROOT / package)
        for line, module in imported_modules(path)
        if module.split(".")[0] in others - MAY_IMPORT[package]
    ]
    allowed = ", ".join(sorted(MAY_IMPORT[package])) or "nothing"
    assert not wrong, f"{package}/ may import only {allowed} of the project:\n" + "\n".join(wrong)


# engine/'s top-level files: the vocabulary every room shares.
ENGINE_SHARED = frozenset({"engine.config", "engine.speculative_config", "engine.args", "engine.sampling_params",
                           "engine.outputs", "engine.errors"})
# What each room of engine/ may import of engine/ besides itself and ENGINE_SHARED.
ROOM_MAY_IMPORT = MappingProxyType({
    "core": frozenset(),
    "sampling": frozenset(),
    "model": frozenset({"engine.sampling", "engine.core.sched_output"}),
    "frontend": frozenset({"engine.core", "engine.sampling", "engine.model",
                           "engine.spec_decode"}),
    "spec_decode": frozenset(),
    # SamplingParams holds a StructuredOutputsParams, the sampling room's request type.
    "": frozenset({"engine.sampling.structured_outputs"}),
})


def _allowed(module: str, room: str) -> bool:
    own = f"engine.{room}" if room else None
    allowed = {*ROOM_MAY_IMPORT[room], *ENGINE_SHARED, *([own] if own else [])}
    return any(module == a or module.startswith(a + ".") for a in allowed)


@pytest.mark.parametrize("room", sorted(ROOM_MAY_IMPORT))
def test_engine_rooms_point_down(room):
    folder = ROOM / room if room else ROOM
    files = python_files(folder) if room else [p for p in folder.glob("*.py")
                                               if p.name != "__init__.py"]
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in files
        for line, module in imported_modules(path)
        if module.startswith("engine.") and not _allowed(module, room)
    ]
    assert not wrong, f"engine/{room or '(top level)'} reaches a room above or beside it:\n" + "\n".join(wrong)


def test_engine_top_level_stays_small():
    entries = [p for p in ROOM.iterdir() if p.name != "__pycache__"]
    assert len(entries) <= 12, sorted(p.name for p in entries)


# service/'s rooms: routes/ on top, then the rooms that do the work, protocol/ at the bottom.
SERVICE = ROOT / "service"
SERVICE_LOWER_ROOMS = ("serving", "responses", "tool_calls", "guards", "protocol", "fleet")
# What only the top of service/ may import: the routes, and the app and command that mount them.
SERVICE_TOP = ("service.routes", "service.app", "service.cli")
# What protocol/ may import of service/ besides itself: the wire types stand alone.
PROTOCOL_MAY_IMPORT = frozenset({"service.errors"})


def _within(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_service_rooms_exist():
    missing = [room for room in ("routes", *SERVICE_LOWER_ROOMS)
               if not (SERVICE / room / "__init__.py").is_file()]
    assert not missing, f"service/ lacks the rooms {missing}"


@pytest.mark.parametrize("path", sorted(p.name for p in (SERVICE / "routes").glob("*.py")
                                        if p.name != "__init__.py"))
def test_service_routes_import_no_other_route(path):
    """A route borrows from serving/, responses/ and the rooms below, never from
    another route; only routes/__init__.py, which builds ROUTES, imports them all."""
    file = SERVICE / "routes" / path
    wrong = [f"{file.relative_to(ROOT)}:{line} imports {module}"
             for line, module in imported_modules(file)
             if _within(module, ("service.routes",))]
    assert not wrong, "a route imports another route (move what they share into a lower " \
                      "room):\n" + "\n".join(wrong)


@pytest.mark.parametrize("room", SERVICE_LOWER_ROOMS)
def test_service_lower_rooms_point_down(room):
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in python_files(SERVICE / room)
             for line, module in imported_modules(path)
             if _within(module, SERVICE_TOP)]
    assert not wrong, f"service/{room} reaches up into {', '.join(SERVICE_TOP)}:\n" + \
        "\n".join(wrong)


def test_service_protocol_stands_alone():
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in python_files(SERVICE / "protocol")
             for line, module in imported_modules(path)
             if _within(module, ("service",)) and not _within(module, ("service.protocol",))
             and not _within(module, PROTOCOL_MAY_IMPORT)]
    assert not wrong, "service/protocol imports another room of service/ (it may import " \
                      "only errors):\n" + "\n".join(wrong)


def source_files():
    """Every non-test Python file of the repository."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in NOT_SOURCE and not d.startswith(".")
                         and not d.endswith(".egg-info"))
        for name in sorted(files):
            if name.endswith(".py"):
                yield Path(folder, name)


def size_offenders(path: Path) -> list[str]:
    text = path.read_text()
    where = path.relative_to(ROOT)
    found = []
    lines = len(text.splitlines())
    if lines > MAX_FILE_LINES:
        found.append(f"{where}: {lines} lines (max {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{where}:{node.lineno} {node.name}() is {length} lines "
                             f"(max {MAX_FUNCTION_LINES})")
    return found


def test_files_and_functions_are_short():
    offenders = [o for path in source_files() for o in size_offenders(path)]
    assert not offenders, "too long to read in one sitting:\n" + "\n".join(offenders)


# -- the dispatcher ------------------------------------------------------------------------
def test_every_command_names_a_module_that_exists():
    for module, _ in [*COMMANDS.values(), *BENCHMARKS.values()]:
        assert importlib.util.find_spec(module) is not None, module


@pytest.mark.parametrize("argv, module, rest", [
    (["serve", "--port", "9"], "service.cli", ["--port", "9"]),
    (["generate"], "pagedserve.generate", []),
    (["bench", "serve", "--help"], "bench.serving.serve", ["--help"]),
    (["bench", "prefix", "--serve"], "bench.offline.prefix_caching", ["--serve"]),
])
def test_resolve_hands_the_rest_to_the_module(argv, module, rest):
    assert resolve(argv) == (module, rest)


@pytest.mark.parametrize("argv, code", [
    ([], 2), (["nope"], 2), (["bench"], 2), (["bench", "nope"], 2), (["--help"], 0),
    (["bench", "--help"], 0),
])
def test_no_command_or_help_is_argparse(argv, code, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == code
    out = capsys.readouterr()
    assert "usage: pagedserve" in out.out + out.err


def test_a_configuration_mistake_is_one_line_and_exit_2(capsys):
    assert main(["generate", "--block-size", "3", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedserve: error: block_size=3 is not supported")
    assert err.count("\n") == 1


def test_help_loads_no_layer():
    """--help lists the commands without importing them (and torch with them)."""
    probe = ("import sys\n"
             "from pagedserve.cli import build_parser\n"
             "build_parser().format_help()\n"
             "print(sorted({'torch', 'engine', 'service', 'bench'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


# -- bench/ in rooms -----------------------------------------------------------------------
# common/ (reports, measuring, workloads, replica processes, the null engine) is the floor;
# each benchmark room stands on it alone, but gpu/ also times with kernels/'s clock.
BENCH = ROOT / "bench"
BENCH_ROOM_MAY_IMPORT = MappingProxyType({
    "common": frozenset(),
    "offline": frozenset({"common"}),
    "serving": frozenset({"common"}),
    "fleet": frozenset({"common"}),
    "kernels": frozenset({"common"}),
    "gpu": frozenset({"common", "kernels"}),
})


def bench_module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path, packages=tuple(MAY_IMPORT)):
    """(line, module) of every import of the project's packages in the file, at any
    depth; `from bench.fleet import routing` names the module bench.fleet.routing."""
    def ours(module: str) -> bool:
        return module.split(".")[0] in packages

    for line, module in imported_modules(path):
        if ours(module):
            yield line, module
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and ours(
                node.module):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if _is_module(name):
                    yield node.lineno, name


def bench_imports(path: Path):
    return project_imports(path, ("bench",))


def _is_module(name: str) -> bool:
    return (ROOT / (name.replace(".", "/") + ".py")).is_file() or (
        ROOT / name.replace(".", "/") / "__init__.py").is_file()


def _type_checking_lines(path: Path) -> set[int]:
    """Lines under `if TYPE_CHECKING:`: read by type checkers, never run."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def import_cycles(folders) -> list[list[str]]:
    """Every cycle among the modules under these folders. Imports inside functions
    count; a package's facade does not: an `__init__` that re-exports its own
    modules is not a loop with them, and type-checking imports never run."""
    def edges(path: Path) -> set[str]:
        skip = _type_checking_lines(path)
        me = bench_module(path)
        return {m for line, m in project_imports(path)
                if line not in skip and m != me and not me.startswith(m + ".")
                and not m.startswith(me + ".")}

    graph = {bench_module(p): edges(p) for folder in folders for p in python_files(folder)}
    cycles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in path:
                cycles.append(path[path.index(target):] + [target])
            elif target not in done:
                visit(target, path + [target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    return cycles


def bench_import_cycles() -> list[list[str]]:
    return import_cycles([BENCH])


def test_bench_has_no_import_cycles():
    cycles = bench_import_cycles()
    assert not cycles, "bench/ imports in a loop:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycles_anywhere():
    cycles = import_cycles([ROOT / package for package in sorted(MAY_IMPORT)])
    assert not cycles, "imports in a loop:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_bench_top_level_is_rooms():
    loose = sorted(p.name for p in BENCH.glob("*.py") if p.name != "__init__.py")
    rooms = sorted(p.name for p in BENCH.iterdir() if (p / "__init__.py").is_file())
    assert not loose, f"bench/ holds only rooms; move these into one: {loose}"
    assert rooms == sorted(BENCH_ROOM_MAY_IMPORT), rooms


@pytest.mark.parametrize("room", sorted(BENCH_ROOM_MAY_IMPORT))
def test_bench_rooms_point_down(room):
    allowed = {room, *BENCH_ROOM_MAY_IMPORT[room]}
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in python_files(BENCH / room)
        for line, module in bench_imports(path)
        if module.split(".")[1:2] and module.split(".")[1] not in allowed
    ]
    others = ", ".join(f"bench/{r}" for r in sorted(BENCH_ROOM_MAY_IMPORT[room])) or "no other room"
    assert not wrong, (f"bench/{room} may import only {others}; these reach a room above "
                       f"or beside it:\n" + "\n".join(wrong))
