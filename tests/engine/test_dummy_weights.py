"""--load-format dummy: a model's real shapes from config.json alone, random weights."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def config_only_folder(tmp_path_factory, smollm2_path):
    """A Qwen3-shaped folder with config.json and a tokenizer, and no weights."""
    from transformers import AutoTokenizer, Qwen3Config

    folder = tmp_path_factory.mktemp("qwen3-config-only")
    Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=512, architectures=["Qwen3ForCausalLM"]).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(smollm2_path)).save_pretrained(folder)
    assert not list(folder.glob("*.safetensors"))
    return folder


def test_dummy_weights_serve_without_a_checkpoint(config_only_folder, single_thread):
    llm = LLM(str(config_only_folder), load_format="dummy", dtype="float32", seed=7)
    model = llm.engine.runner.model
    assert type(model).__name__ == "Qwen3ForCausalLM"
    for name, param in model.named_parameters():
        assert param.abs().max() <= 1e-3, name
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5


def test_dummy_weights_are_seeded(config_only_folder, single_thread):
    first = LLM(str(config_only_folder), load_format="dummy", dtype="float32", seed=3)
    second = LLM(str(config_only_folder), load_format="dummy", dtype="float32", seed=3)
    third = LLM(str(config_only_folder), load_format="dummy", dtype="float32", seed=4)
    a, b, c = (dict(llm.engine.runner.model.named_parameters()) for llm in (first, second, third))
    name = "layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])
    assert first.engine.fingerprint == second.engine.fingerprint != third.engine.fingerprint


def test_a_folder_without_weights_is_refused_unless_dummy(config_only_folder):
    with pytest.raises(Exception, match="safetensors|weights"):
        LLM(str(config_only_folder), dtype="float32")
