"""--num-threads: validated, parsed, and applied in the thread that steps."""

from __future__ import annotations

import argparse
import threading

import pytest
import torch

from engine import LLM, SamplingParams
from engine.args import add_engine_args, config_from_args
from engine.config import EngineConfig


@pytest.mark.parametrize("value", [-1, True, 1.5, "2"])
def test_bad_num_threads(value):
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(num_threads=value)


def test_cli_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["--num-threads", "1"])).num_threads == 1
    assert config_from_args(parser.parse_args([])).num_threads == 0


def test_the_stepping_thread_gets_the_configured_count(tiny_llama_path):
    """The serving engine steps in its own thread, where an OpenMP thread count
    set elsewhere does not reach: the runner applies it there."""
    llm = LLM(str(tiny_llama_path), num_threads=1, max_model_len=64, num_gpu_blocks_override=8)
    seen = {}

    def step_here():
        torch.set_num_threads(2)
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        seen["threads"] = torch.get_num_threads()

    worker = threading.Thread(target=step_here)
    worker.start()
    worker.join(timeout=60)
    assert seen == {"threads": 1}
