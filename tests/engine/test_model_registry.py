"""A checkpoint the engine cannot serve exactly is refused at start-up, naming
what is missing: never loaded into a model that would give other tokens."""

from __future__ import annotations

import pytest
from transformers import (Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                          Qwen3Config)

from engine.model.layers.rotary import RotaryEmbedding
from engine.model.models.args import ModelArgs
from engine.model.models.registry import ARCHITECTURES, model_class

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)


def test_an_unknown_architecture_is_refused_by_name():
    config = LlamaConfig(**SMALL, architectures=["FalconForCausalLM"])
    with pytest.raises(ValueError, match="'FalconForCausalLM' is not supported; supported: .*Qwen3"):
        model_class(config)


def test_every_registered_class_is_named_in_the_message():
    config = LlamaConfig(**SMALL, architectures=["Nope"])
    with pytest.raises(ValueError) as exc:
        model_class(config)
    assert all(name in str(exc.value) for name in ARCHITECTURES)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                   "long_factor": [1.0] * 8}])
def test_length_dependent_rope_is_refused(rope):
    config = LlamaConfig(**SMALL, rope_parameters={"rope_theta": 10000.0, **rope})
    with pytest.raises(ValueError, match=f"RoPE type '{rope['rope_type']}' is not supported"):
        RotaryEmbedding(config, 16)


def test_partial_rotary_is_refused():
    config = Phi3Config(**SMALL, partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        RotaryEmbedding(config, 16)


def test_an_unknown_layer_type_is_refused():
    config = Qwen3Config(**SMALL)
    config.layer_types = ["full_attention", "chunked_attention", "full_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported"):
        ModelArgs.from_hf_config(config)


@pytest.mark.parametrize("config, windows", [
    (LlamaConfig(**SMALL), (None,) * 4),
    (MistralConfig(**SMALL, sliding_window=32), (32,) * 4),
    (MistralConfig(**SMALL, sliding_window=None), (None,) * 4),
    (Qwen2Config(**SMALL, use_sliding_window=False, sliding_window=32), (None,) * 4),
    (Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=32, max_window_layers=2),
     (None, None, 32, 32)),
    (Gemma3TextConfig(**SMALL, sliding_window=32,
                      layer_types=["sliding_attention"] * 3 + ["full_attention"]), (32, 32, 32, None)),
])
def test_each_layers_window_is_read_as_transformers_reads_it(config, windows):
    assert ModelArgs.from_hf_config(config).sliding_windows == windows
