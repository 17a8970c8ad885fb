"""GGUFCheckpoint against tiny GGUF files of every family (tests/gguf_models.py).

  * its config gives our model classes the tiny model's numbers;
  * dequantized_tensors() equals, bit for bit, the state dict transformers'
    own GGUF loader builds from the file (names and value transforms);
  * tensors() hands quantized weights out as QuantTensor views whose rows,
    de-quantized, are those same values (row permutations applied as bytes),
    for the legacy types, the K types and a Q4_K_M-like mix;
  * an unsupported tensor type or architecture is refused at open, by name.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from engine.model.layers.rotary import rope_parameters
from engine.model.models.gguf_file import (SUPPORTED_TYPES, GGUFCheckpoint, QuantTensor,
                                           load_gguf_tokenizer)
from engine.model.models.registry import model_class
from engine.model.models.loader import default_gguf_path
from gguf_models import GGUF_FAMILIES, K_SHAPE, TINY_VOCAB, tiny_settings, write_tiny_gguf

# transformers' own GGUF config gets these families' shapes wrong (its mapping
# drops head_dim, moe_intermediate_size) or, for Mixtral, loads a dense Llama;
# their reference is built on our config.
TRANSFORMERS_CONFIG_WRONG = {"qwen3", "qwen3-moe", "mixtral"}


@pytest.fixture(scope="module")
def gguf_file(tiny_gguf):
    """(family, tensor_type) -> (a GGUF file, its GGUFCheckpoint), opened once per module."""
    files = {}

    def get(family: str, tensor_type: str = "Q8_0"):
        if (family, tensor_type) not in files:
            path = tiny_gguf(family, tensor_type)
            files[family, tensor_type] = (path, GGUFCheckpoint.open(path))
        return files[family, tensor_type]

    return get


def _tiny_config(family: str):
    import transformers

    config_name, _, settings = tiny_settings(family)
    return getattr(transformers, config_name)(**settings)


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_config_gives_our_classes_the_tiny_models_numbers(gguf_file, family):
    _, checkpoint = gguf_file(family)
    ours, tiny = checkpoint.config, _tiny_config(family)
    cls = model_class(ours)
    assert cls is model_class(tiny)
    assert _float32_eps(cls.model_args(ours)) == _float32_eps(cls.model_args(tiny))
    for kind in sorted(set(cls.model_args(tiny).layer_types)):
        (inv_ours, scale_ours), (inv_tiny, scale_tiny) = (rope_parameters(c, kind) for c in (ours, tiny))
        assert torch.equal(inv_ours, inv_tiny) and scale_ours == scale_tiny, kind


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_dequantized_tensors_equal_transformers_gguf_loader(gguf_file, family):
    from transformers import AutoModelForCausalLM

    path, checkpoint = gguf_file(family)
    extra = {"config": checkpoint.config} if family in TRANSFORMERS_CONFIG_WRONG else {}
    if family == "mixtral":
        pytest.skip("transformers loads a llama-with-experts file as a dense Llama: no reference")
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **extra).state_dict()
    ours = _fuse_experts(dict(checkpoint.dequantized_tensors()))
    if checkpoint.config.tie_word_embeddings:
        reference.pop("lm_head.weight")
    assert sorted(ours) == sorted(reference)
    for name, value in ours.items():
        assert torch.equal(value, reference[name]), name


def _float32_eps(args):
    """GGUF stores the norm epsilon as float32; the norms add it to float32 values."""
    return dataclasses.replace(args, rms_norm_eps=float(np.float32(args.rms_norm_eps)))


def _fuse_experts(tensors: dict) -> dict:
    """Per-expert tensors into transformers 5's [E, ...] gate_up_proj and down_proj."""
    fused, experts = {}, {}
    for name, value in tensors.items():
        stem, sep, rest = name.partition(".experts.")
        if not sep:
            fused[name] = value
            continue
        index, proj = rest.split(".")[:2]
        experts.setdefault(stem, {}).setdefault(proj, {})[int(index)] = value
    for stem, parts in experts.items():
        count = len(parts["down_proj"])
        fused[f"{stem}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate_proj"][e], parts["up_proj"][e]]) for e in range(count)])
        fused[f"{stem}.experts.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(count)])
    return fused


def test_q8_0_values_are_the_hf_weights_quantized(gguf_file):
    """Independent of transformers: the writer's inverse transforms and the
    reader's transforms cancel (Llama's q/k permutation, checked here)."""
    import gguf

    from tiny_models import build_tiny

    _, checkpoint = gguf_file("llama")
    model = build_tiny(*tiny_settings("llama"), seed=1234)
    ours = dict(checkpoint.dequantized_tensors())
    for name, weight in model.state_dict().items():
        weight = weight.numpy()
        if weight.ndim == 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            weight = gguf.quants.dequantize(gguf.quants.quantize(weight, q8), q8)
        assert np.array_equal(ours[name].numpy(), weight), name


CASES = [(family, "Q8_0") for family in GGUF_FAMILIES] + [
    ("llama", "Q5_0"), ("llama", "Q4_K"), ("llama", "Q5_K"), ("llama", "Q6_K"),
    ("llama", "Q4_K_M"), ("gemma3", "Q4_K_M"), ("qwen3-moe", "Q4_K_M")]


@pytest.mark.parametrize("family,tensor_type", CASES)
def test_quantized_tensors_are_views_with_the_right_rows(gguf_file, family, tensor_type):
    _, checkpoint = gguf_file(family, tensor_type)
    reference = dict(checkpoint.dequantized_tensors())
    seen, types = set(), set()
    for name, value in checkpoint.tensors():
        seen.add(name)
        if isinstance(value, QuantTensor):
            types.add(value.type_name)
            assert value.type_name in SUPPORTED_TYPES
            assert value.data.dtype == torch.uint8 and value.data.shape[0] == value.shape[0]
            assert value.shape == tuple(reference[name].shape), name
            assert torch.equal(value.dequantize(), reference[name]), name
        else:
            assert torch.equal(value.float(), reference[name]), name
    assert seen == set(reference)
    expected = {"Q4_K_M": {"Q4_K", "Q6_K"}}.get(tensor_type, {tensor_type})
    assert types == expected


def test_take_rows_and_rows_select_whole_rows(gguf_file):
    _, checkpoint = gguf_file("llama", "Q4_K")
    value = next(v for n, v in checkpoint.tensors() if n.endswith("layers.0.mlp.up_proj.weight"))
    full = value.dequantize()
    index = torch.tensor([5, 0, 511, 7])
    assert torch.equal(value.take_rows(index).dequantize(), full[index])
    part = value.rows(3, 9)
    assert part.shape == (6, value.shape[1]) and torch.equal(part.dequantize(), full[3:9])
    assert part.data.data_ptr() == value.data[3].data_ptr()  # a view: no bytes copied


def reopened_from_its_index(path, checkpoint) -> GGUFCheckpoint:
    """The file opened as a model folder opens it: config, names and index kept."""
    index = json.loads(json.dumps(checkpoint.index()))  # through JSON, as the folder keeps it
    return GGUFCheckpoint.open(path, checkpoint.config, checkpoint.names, index)


@pytest.mark.parametrize("family,tensor_type", [("llama", "Q4_K_M"), ("qwen3-moe", "Q4_K_M"),
                                                ("gemma3", "Q8_0"), ("llama", "Q5_1")])
def test_an_index_opens_the_same_tensors_without_the_reader(gguf_file, family, tensor_type):
    path, checkpoint = gguf_file(family, tensor_type)
    again = reopened_from_its_index(path, checkpoint)
    assert (again.architecture, again.chat_template) == (checkpoint.architecture,
                                                         checkpoint.chat_template)
    for (name, value), (name_again, value_again) in zip(checkpoint.tensors(), again.tensors(),
                                                        strict=True):
        assert name_again == name
        if isinstance(value, QuantTensor):
            assert (value_again.type_name, value_again.shape) == (value.type_name, value.shape)
            assert torch.equal(value_again.data, value.data), name
        else:
            assert value_again.dtype == value.dtype and torch.equal(value_again, value), name


@pytest.mark.parametrize("opened", ["by the reader", "from its index"])
def test_quantized_weights_are_not_copied(gguf_file, opened):
    """Unpermuted quantized tensors view the memory map; q/k come permuted (copies)."""
    path, checkpoint = gguf_file("llama", "Q4_K")
    if opened == "from its index":
        checkpoint = reopened_from_its_index(path, checkpoint)
    mapped = checkpoint.mapping
    start, stop = mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes
    for name, value in checkpoint.tensors():
        if isinstance(value, QuantTensor):
            inside = start <= value.data.data_ptr() < stop
            assert inside == (".q_proj." not in name and ".k_proj." not in name), name


def test_tied_head_and_metadata(gguf_file):
    path, checkpoint = gguf_file("gemma2")
    assert checkpoint.architecture == "gemma2" and checkpoint.config.tie_word_embeddings
    assert "lm_head.weight" not in dict(checkpoint.dequantized_tensors())
    assert "<|im_start|>" in checkpoint.chat_template


def test_tokenizer_from_metadata(gguf_file):
    # transformers picks the tokenizer class by architecture: a gemma2 file
    # gets Gemma's (and an extra <mask> token) whatever tokenizer.ggml.model says.
    path, _ = gguf_file("llama")
    tokenizer = load_gguf_tokenizer(path)
    assert len(tokenizer) == TINY_VOCAB and tokenizer.decode(tokenizer.encode("Hello there")) == "Hello there"


@pytest.mark.parametrize("bad_type", ["Q2_K", "IQ4_NL"])
def test_unsupported_tensor_type_is_refused_by_name(tmp_path, bad_type):
    path = write_tiny_gguf(tmp_path / "bad.gguf", "llama", default_gguf_path(), "Q8_0",
                           override_types={"blk.1.ffn_down.weight": bad_type}, **K_SHAPE)
    with pytest.raises(ValueError) as error:
        GGUFCheckpoint.open(path)
    message = str(error.value)
    assert "blk.1.ffn_down.weight" in message and bad_type in message and "Q4_K" in message


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    import gguf

    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2moe")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'qwen2moe' is not supported; supported: llama, qwen2"):
        GGUFCheckpoint.open(path)
