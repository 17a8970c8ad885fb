"""EngineConfig validation: every refusal is a ValueError that names the field
(and the value), and start-up checks that need the model go through LLM(...)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from engine import LLM
from engine.args import add_engine_args, config_from_args
from engine.config import EngineConfig


# On a busy 2-core machine two OpenMP threads make small ops wait on each other.
pytestmark = pytest.mark.usefixtures("single_thread")


def test_defaults_are_valid():
    config = EngineConfig()
    assert config.block_size == 16
    assert config.max_model_len == 0
    assert isinstance(config.cache_dir, Path)


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, 32, 64, 128])
def test_power_of_two_block_sizes_accepted(block_size):
    assert EngineConfig(block_size=block_size, max_num_batched_tokens=128).block_size == block_size


@pytest.mark.parametrize(
    "block_size, pattern",
    [
        (0, r"block_size=0 must be >= 1"),
        (-4, r"block_size=-4 must be >= 1"),
        (3, r"block_size=3 is not supported: use a power of two"),
        (12, r"block_size=12 is not supported"),
        (256, r"block_size=256 is not supported.*from 1 to 128"),
    ],
)
def test_bad_block_size(block_size, pattern):
    with pytest.raises(ValueError, match=pattern):
        EngineConfig(block_size=block_size)


def test_max_num_batched_tokens_below_block_size():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=8 must be at least block_size=16"):
        EngineConfig(block_size=16, max_num_batched_tokens=8)
    assert EngineConfig(block_size=16, max_num_batched_tokens=16).max_num_batched_tokens == 16


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.5, 1.0000001, float("nan")])
def test_bad_gpu_memory_utilization(value):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=.* must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=value)


@pytest.mark.parametrize("value", [1e-6, 0.5, 1.0, 1])
def test_good_gpu_memory_utilization(value):
    assert EngineConfig(gpu_memory_utilization=value).gpu_memory_utilization == value


@pytest.mark.parametrize("value", [-0.1, -1, float("nan"), "1", None, True])
def test_bad_schedule_conservativeness(value):
    with pytest.raises(ValueError, match=r"schedule_conservativeness must be a number >= 0"):
        EngineConfig(schedule_conservativeness=value)


@pytest.mark.parametrize("value", [0, 0.0, 0.5, 1.0, 3])
def test_good_schedule_conservativeness(value):
    assert EngineConfig(schedule_conservativeness=value).schedule_conservativeness == value


@pytest.mark.parametrize(
    "field, value",
    [
        ("gpu_memory_utilization", "0.9"),
        ("gpu_memory_utilization", None),
        ("gpu_memory_utilization", True),
        ("device", None),
        ("device", 0),
        ("enable_prefix_caching", "no"),
    ],
)
def test_wrong_types_are_value_errors_naming_the_field(field, value):
    """Like SamplingParams, a wrong type must be a ValueError naming the field,
    not a TypeError/AttributeError from deep inside validation, nor accepted."""
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("dtype", ["int8", "fp16", "Float32", ""])
def test_bad_dtype(dtype):
    with pytest.raises(ValueError, match=rf"dtype={dtype!r} is not supported"):
        EngineConfig(dtype=dtype)


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16", "float16"])
def test_good_dtype(dtype):
    assert EngineConfig(dtype=dtype).dtype == dtype


def test_bad_kernel_backend_and_device():
    with pytest.raises(ValueError, match=r"kernel_backend='cuda' is not supported"):
        EngineConfig(kernel_backend="cuda")
    with pytest.raises(ValueError, match=r"device='tpu' must be"):
        EngineConfig(device="tpu")
    assert EngineConfig(device="cuda:1").device == "cuda:1"


@pytest.mark.parametrize("size", [2, 8])
def test_tensor_parallel_size_is_a_plain_setting(size):
    # Whether the model splits that way is the model's question, asked at load.
    assert EngineConfig(tensor_parallel_size=size).tensor_parallel_size == size


def test_tensor_parallel_zero_is_below_minimum():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0 must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", 16.0),
        ("block_size", "16"),
        ("block_size", True),
        ("max_num_seqs", 2.5),
        ("max_num_seqs", None),
        ("max_num_batched_tokens", "8192"),
        ("max_model_len", 512.0),
        ("tensor_parallel_size", 1.0),
        ("kv_cache_memory_bytes", 1e9),
        ("seed", "0"),
        ("seed", False),
    ],
)
def test_non_int_values(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be an integer, got {value!r}"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [("max_num_seqs", 0), ("max_num_batched_tokens", 0), ("max_model_len", -1),
     ("kv_cache_memory_bytes", 0), ("seed", -1)],
)
def test_ints_below_minimum(field, value):
    with pytest.raises(ValueError, match=rf"{field}={value} must be >= "):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("value", [0, 1, 2.0, "8"])
def test_bad_num_gpu_blocks_override(value):
    with pytest.raises(ValueError, match=r"num_gpu_blocks_override=.* must be an integer >= 2"):
        EngineConfig(num_gpu_blocks_override=value)


def test_config_is_frozen():
    config = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_model_len = 10
    assert config.block_size == 16


def test_replace_validates_and_leaves_original():
    config = EngineConfig(block_size=16)
    changed = config.replace(block_size=32)
    assert (config.block_size, changed.block_size) == (16, 32)
    with pytest.raises(ValueError, match="block_size=3"):
        config.replace(block_size=3)


def test_resolve_max_model_len():
    assert EngineConfig().resolve_max_model_len(1024).max_model_len == 1024
    assert EngineConfig(max_model_len=300).resolve_max_model_len(1024).max_model_len == 300
    assert EngineConfig(max_model_len=1024).resolve_max_model_len(1024).max_model_len == 1024
    with pytest.raises(
        ValueError, match=r"max_model_len=1025 exceeds the model's limit \(max_position_embeddings=1024\)"
    ):
        EngineConfig(max_model_len=1025).resolve_max_model_len(1024)


# -- the engine flags, generated from the fields (engine/args.py) ---------------------------
def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    add_engine_args(parser)
    return parser


def flag_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True)]


def test_no_flags_give_the_default_config():
    assert config_from_args(engine_parser().parse_args([])) == EngineConfig()


def test_every_flag_defaults_to_its_field():
    args = engine_parser().parse_args([])
    for field in flag_fields():
        if field.default is dataclasses.MISSING:  # a computed default: left to EngineConfig
            assert not hasattr(args, field.name)
        else:
            assert getattr(args, field.name) == field.default, field.name


def test_only_api_knobs_are_not_flags():
    every = {f.name for f in dataclasses.fields(EngineConfig)}
    not_flags = every - {f.name for f in flag_fields()}
    assert not_flags == {"num_gpu_blocks_override", "num_window_blocks_override", "cache_dir"}


def test_every_flag_has_its_help(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag: no hyphen broken by wrapping
    text = " ".join(engine_parser().format_help().split())
    for field in flag_fields():
        help_text = field.metadata.get("help", "")
        assert help_text.strip(), f"{field.name} has no help"
        flag = "--" + field.name.replace("_", "-")
        assert f"{flag} " in text and " ".join(help_text.split()) in text, field.name


def test_the_documented_flags_keep_their_spelling():
    argv = ["--model", "m", "--tokenizer", "t", "--dtype", "bfloat16", "--quantization", "q4_0",
            "--block-size", "32", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
            "--max-model-len", "128", "--gpu-memory-utilization", "0.5",
            "--kv-cache-memory-bytes", "4096", "--tensor-parallel-size", "1",
            "--no-enable-prefix-caching", "--kernel-backend", "torch", "--device", "cpu",
            "--num-threads", "2", "--seed", "7", "--schedule-conservativeness", "0.5",
            "--kv-cache-dtype", "int8"]
    assert config_from_args(engine_parser().parse_args(argv)) == EngineConfig(
        model="m", tokenizer="t", dtype="bfloat16", quantization="q4_0", block_size=32,
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
        gpu_memory_utilization=0.5, kv_cache_memory_bytes=4096, kv_cache_dtype="int8",
        tensor_parallel_size=1,
        enable_prefix_caching=False, kernel_backend="torch", device="cpu", num_threads=2, seed=7,
        schedule_conservativeness=0.5)
    assert engine_parser().parse_args(["--enable-prefix-caching"]).enable_prefix_caching is True


@pytest.mark.parametrize("argv", [["--dtype", "int8"], ["--quantization", "None"],
                                  ["--kernel-backend", "cuda"], ["--block-size", "x"]])
def test_flags_outside_their_choices_or_type_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        engine_parser().parse_args(argv)
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err


CACHE_DTYPE_CHOICES = (r"choose one of \('auto', 'bfloat16', 'float32', 'int8', 'fp8', 'fp8_e4m3', "
                       r"'fp8_e5m2'\)")


@pytest.mark.parametrize("value", ["float16", "int4", "fp8_inc", "", None, 8])
def test_other_kv_cache_dtypes_are_refused_with_the_choices(value):
    with pytest.raises(ValueError, match=rf"kv_cache_dtype={value!r} is not supported: "
                                         rf"{CACHE_DTYPE_CHOICES}"):
        EngineConfig(kv_cache_dtype=value)


def test_the_kv_cache_dtype_flag_names_its_choices(capsys):
    assert engine_parser().parse_args([]).kv_cache_dtype == "auto"
    assert engine_parser().parse_args(["--kv-cache-dtype", "fp8_e5m2"]).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(SystemExit) as exc:
        engine_parser().parse_args(["--kv-cache-dtype", "fp8_inc"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--kv-cache-dtype" in err
    assert all(f"'{name}'" in err for name in ("auto", "bfloat16", "float32", "int8", "fp8")), err


def test_flag_values_go_through_the_config_checks():
    with pytest.raises(ValueError, match="block_size=3 is not supported"):
        config_from_args(engine_parser().parse_args(["--block-size", "3"]))


# -- start-up through LLM(...) -------------------------------------------------------------
def test_llm_refuses_max_model_len_beyond_model_limit(tiny_llama_path):
    with pytest.raises(ValueError, match=r"max_model_len=2048 exceeds the model's limit.*1024"):
        LLM(str(tiny_llama_path), dtype="float32", max_model_len=2048, num_gpu_blocks_override=200)


def test_llm_refuses_kv_cache_too_small(tiny_llama_path):
    # one block of the tiny model: 2 (K, V) * 2 layers * 16 tokens * 2 kv heads * 16 dims * 4 bytes = 8192
    with pytest.raises(
        ValueError,
        match=r"KV cache too small: kv_cache_memory_bytes=81920 gives 10 blocks.*8192 bytes each.*"
        r"max_model_len=1024 sequence needs 65 blocks",
    ):
        LLM(str(tiny_llama_path), dtype="float32", block_size=16, kv_cache_memory_bytes=81920)
    with pytest.raises(ValueError, match=r"KV cache too small: num_gpu_blocks_override gives 8 "
                                         r"blocks.*max_model_len=128 sequence needs 9 blocks"):
        LLM(str(tiny_llama_path), dtype="float32", block_size=16, max_model_len=128, num_gpu_blocks_override=8)
    with pytest.raises(ValueError, match=r"KV cache too small.*gives 0 blocks"):
        LLM(str(tiny_llama_path), dtype="float32", kv_cache_memory_bytes=1)


def test_llm_accepts_exactly_enough_kv_blocks(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), dtype="float32", block_size=16, max_model_len=128, num_gpu_blocks_override=9,
              max_num_batched_tokens=128)
    assert llm.config.max_model_len == 128
    assert llm.engine.block_manager.num_usable_blocks == 8
    # the longest possible request (127 prompt tokens + 1 output) runs
    from engine import SamplingParams

    out = llm.generate([list(range(5, 132))], SamplingParams(temperature=0, max_tokens=10),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1
    assert out[0].outputs[0].finish_reason == "length"
    assert llm.engine.block_manager.num_free_blocks == 8
