"""The engine's runner seam, as the benchmarks use it: LLMEngine around a null
runner (no model loaded), and the shared report helpers."""

from __future__ import annotations

import pytest

from bench.common.null_engine import NULL_MODEL, EngineDriver, NullRunner, fake_token, make_scheduler
from bench.common.report import percentile, print_table
from engine.config import EngineConfig
from engine.frontend.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def null_config(**changes) -> EngineConfig:
    settings = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                    num_gpu_blocks_override=32, device="cpu")
    return EngineConfig(**{**settings, **changes})


def test_engine_around_a_null_runner_generates_fake_tokens():
    config = null_config()
    runner = NullRunner(config.num_gpu_blocks_override)
    engine = LLMEngine(config, runner=runner, model_info=NULL_MODEL)
    assert engine.tokenizer is None and engine.model_path is None
    assert engine.vocab_size == NULL_MODEL.vocab_size
    assert engine.block_manager.num_blocks == 32
    engine.add_request("a", [101, 102, 103, 104, 105], SamplingParams(max_tokens=3))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    [completion] = outputs[-1].outputs
    seq_id = 0  # the engine's first sequence
    assert completion.token_ids == [fake_token(seq_id, p) for p in (5, 6, 7)]
    assert completion.finish_reason == "length" and completion.text == ""
    assert runner.last is not None and runner.elapsed_ns > 0


def test_engine_takes_a_given_scheduler():
    config = null_config(enable_prefix_caching=True)
    scheduler = make_scheduler(config)
    engine = LLMEngine(config, runner=NullRunner(32), model_info=NULL_MODEL, scheduler=scheduler)
    assert engine.scheduler is scheduler and engine.block_manager is scheduler.block_manager


def test_engine_driver_counts_the_step_it_ran():
    driver = EngineDriver(null_config())
    driver.add([101] * 6, SamplingParams(max_tokens=2, ignore_eos=True))
    driver.step()
    assert driver.take_output().num_batched_tokens == 6  # the prefill
    assert driver.take_output().is_empty  # taken: nothing new ran


def test_seam_refuses_what_it_cannot_run():
    runner = NullRunner(32)
    with pytest.raises(ValueError, match="together"):
        LLMEngine(null_config(), runner=runner)
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine(null_config(max_model_len=0), runner=runner, model_info=NULL_MODEL)
    big = make_scheduler(null_config(num_gpu_blocks_override=64))
    with pytest.raises(ValueError, match="exceed"):
        LLMEngine(null_config(), runner=runner, model_info=NULL_MODEL, scheduler=big)


def test_percentile_interpolates_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) == 0.0


def test_print_table_keeps_wide_rows_on_one_line(capsys):
    print_table(["run", "seconds"], [["a label far wider than eighty columns " * 3, "1.5"]])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[-1].rstrip().endswith("1.5")
