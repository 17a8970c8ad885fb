"""Shared fixtures: the real SmolLM2 and a tiny random-weight Llama, both on disk.

Both are real HF folders (config.json + safetensors + tokenizer), loaded by the
same code path users take. The tiny model borrows SmolLM2's tokenizer so text
prompts work on it too.

`make test` runs the suite in lanes (scripts/test_lanes.sh; the lists in
tests/lanes.py): first the SERIAL modules alone, with the BACKGROUND ones
beside them at idle priority; then
every other module two at a time (pytest-xdist, one module per worker, one
OpenMP thread each), the OWN_PROCESS ones in a pytest of their own beside it.
A serial module times the server against the wall clock (a token gap, a paced
refusal, a drain, a heavy request beside a light one), so it must not share
the two cores with another module at the same priority; a background module
has no wall-clock deadline, so it can wait while they run.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine.config import DEFAULT_MODEL, default_cache_dir
from engine.model.models.loader import default_gguf_path, resolve_model_path
from lanes import LANES, PARALLEL_FIRST
from need import need
from tiny_models import keep_first_layers, make_tiny_model


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parents[1]
    named = [path for paths in (*LANES.values(), PARALLEL_FIRST) for path in paths]
    missing = sorted(path for path in named if not (root / path).is_file())
    if missing:  # a moved module would silently leave its lane
        raise pytest.UsageError(f"tests/lanes.py names no file: {missing}")
    if len(named) != len(set(named)):
        raise pytest.UsageError(f"tests/lanes.py names a file twice: {sorted(named)}")
    for item in items:
        path = item.path.relative_to(root).as_posix()
        for mark, paths in LANES.items():
            if path in paths:
                item.add_marker(getattr(pytest.mark, mark))


class ModuleSeconds:
    """Each module's setup + call + teardown seconds, the lane's slowest
    printed at the end: where the suite's minutes go (--durations names
    single tests; a module's fixtures and many small cases hide there).
    xdist sends every worker's reports to the controller, so this sees the
    whole lane, and when each worker's last test ended: the gap between the
    first and the last to finish is a tail where one core had no module."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.started = time.monotonic()
        self.worker_ended: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        module = report.nodeid.split("::")[0]
        self.seconds[module] = self.seconds.get(module, 0.0) + report.duration
        node = getattr(report, "node", None)  # the xdist worker, on the controller
        if node is not None:
            self.worker_ended[node.gateway.id] = time.monotonic() - self.started

    def pytest_terminal_summary(self, terminalreporter):
        if not self.seconds:
            return
        terminalreporter.section("slowest modules (setup + call + teardown)")
        for module, total in sorted(self.seconds.items(), key=lambda item: -item[1])[:25]:
            terminalreporter.write_line(f"{total:8.1f}s  {module}")
        if self.worker_ended:
            ends = ", ".join(f"{worker} {end:.0f} s" for worker, end in sorted(self.worker_ended.items()))
            terminalreporter.write_line(f"each worker's last test ended at: {ends}")


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.pluginmanager.register(ModuleSeconds(), "module-seconds")


@pytest.fixture(scope="module")
def single_thread():
    """One torch thread for a module, restored after it.

    The tiny model's ops are small; with two OpenMP threads on a busy 2-core
    machine each op waits on the other thread and a module runs ~10x slower.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    try:
        return resolve_model_path(DEFAULT_MODEL, default_cache_dir())
    except ValueError as exc:
        need(False, f"the default model is not available: {exc}")


@pytest.fixture(scope="session")
def smollm2_short_path(tmp_path_factory, smollm2_path) -> Path:
    """SmolLM2 (float32, de-quantized from its file) cut to its first 4 of 30
    layers: the real weights and every shape (hidden 576, head_dim 64, 3 KV
    heads, the tied 49,152-row head) at about a third of the compute. For the
    modules whose subject is a path through the engine, not the model's text."""
    return keep_first_layers(smollm2_path, tmp_path_factory.mktemp("smollm2-short"), 4)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """(family, tensor_type) -> a tiny random GGUF file of that family
    (tests/gguf_models.py), written once per session, with SmolLM2's tokenizer."""
    from gguf_models import shape_for, write_tiny_gguf

    try:
        tokenizer = default_gguf_path()
    except ValueError as exc:
        need(False, f"SmolLM2's GGUF is not available: {exc}")
    folder, files = tmp_path_factory.mktemp("gguf"), {}

    def get(family: str, tensor_type: str = "Q8_0") -> Path:
        if (family, tensor_type) not in files:
            path = folder / f"{family}-{tensor_type}.gguf"
            files[family, tensor_type] = write_tiny_gguf(path, family, tokenizer, tensor_type,
                                                         **shape_for(family, tensor_type))
        return files[family, tensor_type]

    return get


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, smollm2_path) -> Path:
    """A 2-layer Llama with GQA (4 query heads, 2 KV heads) and random weights."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), smollm2_path)
