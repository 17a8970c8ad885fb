"""A GGUF file read as it is: its config, tokenizer and tensors, the
quantized ones left in their blocks.

`gguf`'s reader memory-maps the file, so opening it reads only the metadata
and the tensor index; a quantized tensor comes out as a QuantTensor, a view
of its bytes in the map, and no bytes move until the model packs them into
a blob (kernels/quant.py). What HF transformers' GGUF loader knows, this
reuses rather than restates: the metadata -> config mapping (AutoConfig with
`gguf_file`), the tensor names (`get_gguf_hf_weights_map` over a model built
on the meta device) and each architecture's value transforms (its
TensorProcessor: Llama's q/k row permutation, Gemma's norms stored as 1 + w).

A transform that moves whole rows (Llama's permutation) is applied to the
quantized rows themselves: a row's blocks are its own, so reordering rows
never touches a value. One that changes values (Gemma's norm - 1, MoE expert
splitting) runs on de-quantized floats, as transformers runs it; the norms it
touches are float32 in every file, and an architecture whose processor
reshapes quantized matrices (the MoE families) has those tensors
de-quantized here, the file's values in float32.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

QUANT_TYPE_NAMES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPE_NAMES = ("F32", "F16", "BF16")
# general.architecture values served (mistral files say llama); MoE ones de-quantize experts.
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen2moe", "qwen3moe")
ROW_PROCESSORS = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor")


@dataclass(frozen=True)
class QuantTensor:
    """A weight as the file stores it: `data` uint8 [rows, row_bytes], each
    row that row's blocks; `shape` (rows, cols) as nn.Linear's [out, in]."""

    type_name: str
    data: torch.Tensor
    shape: tuple[int, int]

    def take_rows(self, index) -> "QuantTensor":
        index = torch.as_tensor(index, dtype=torch.long)
        return QuantTensor(self.type_name, self.data.index_select(0, index),
                           (len(index), self.shape[1]))


class GGUFCheckpoint:
    """One GGUF file: `architecture`, `hf_config` and `tensors()`."""

    def __init__(self, path: Path, reader, hf_config, config_dict: dict) -> None:
        self.path = path
        self.reader = reader
        self.hf_config = hf_config
        self.config_dict = config_dict
        self.architecture = _field(reader, "general.architecture")

    @classmethod
    def open(cls, path, hf_config=None) -> "GGUFCheckpoint":
        """Read the file's index; `hf_config`: its config when already known
        (a model folder's config.json), else mapped from the metadata again."""
        from gguf import GGUFReader

        path = Path(path)
        reader = GGUFReader(str(path))
        architecture = _field(reader, "general.architecture")
        if architecture not in ARCHITECTURES:
            raise ValueError(f"{path.name}: GGUF architecture {architecture!r} is not served; "
                             f"supported: {', '.join(ARCHITECTURES)}")
        check_tensor_types(reader, path.name)
        hf_config = hf_config if hf_config is not None else config_of(path)
        return cls(path, reader, hf_config, hf_config.to_dict())

    def tensors(self) -> Iterator[tuple[str, object]]:
        """(HF name, value) of every tensor: floats as torch tensors, supported
        quantized 2-D weights as QuantTensor (MoE experts de-quantized)."""
        yield from self._tensors(dequantize=False)

    def dequantized_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as float32, the file's values, HF-named (the reference)."""
        for name, value in self._tensors(dequantize=True):
            yield name, value.float()

    def _tensors(self, dequantize: bool) -> Iterator[tuple[str, object]]:
        from gguf import dequantize as gguf_dequantize
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                              get_gguf_hf_weights_map)

        processor = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)(config=self.config_dict)
        rows_only = type(processor).__name__ in ROW_PROCESSORS
        names = (self._names() if rows_only
                 else get_gguf_hf_weights_map(_meta_model(self.hf_config), processor))
        parsed = {"config": self.config_dict, "tensors": {}}
        for tensor in self.reader.tensors:
            kind = tensor.tensor_type.name
            if kind in QUANT_TYPE_NAMES and not dequantize and rows_only and len(tensor.shape) == 2:
                name = names.get(tensor.name)
                if name is not None:
                    yield name, self._quantized(tensor, processor)
                continue
            weights = gguf_dequantize(tensor.data, tensor.tensor_type)
            result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=names,
                                       parsed_parameters=parsed)
            if result.name in names:
                yield names[result.name], torch.from_numpy(np.array(result.weights))
        # MoE processors gather experts into parsed["tensors"] themselves.
        yield from parsed["tensors"].items()

    def _names(self) -> dict[str, str]:
        """GGUF tensor name -> HF name, by gguf's own name map (transformers'
        get_gguf_hf_weights_map does the same, building the map once per
        submodule: ~5 s for SmolLM2; MoE families still take it, for its
        expert fallbacks)."""
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

        arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == self.architecture)
        name_map = get_tensor_name_map(arch, self.hf_config.num_hidden_layers)
        names = {}
        for hf_name in _meta_model(self.hf_config).state_dict():
            stem, dot, suffix = hf_name.rpartition(".")
            gguf_name = name_map.get_name(stem)
            if gguf_name is not None:
                names[f"{gguf_name}.{suffix}"] = hf_name
        return names

    def _quantized(self, tensor, processor) -> QuantTensor:
        """A quantized tensor as a QuantTensor, its rows moved as the
        architecture's processor would move the de-quantized rows."""
        with warnings.catch_warnings():  # a read-only map: its bytes are only read or copied
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.asarray(tensor.data)).view(torch.uint8)
        rows, cols = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists the shape innermost first
        value = QuantTensor(tensor.tensor_type.name, data.view(rows, -1), (rows, cols))
        index = np.arange(rows, dtype=np.int64)[:, None].astype(np.float32)
        moved = processor.process(weights=index, name=tensor.name, tensor_key_mapping={},
                                  parsed_parameters={"config": self.config_dict, "tensors": {}})
        order = np.asarray(moved.weights).reshape(-1).astype(np.int64)
        if not np.array_equal(order, np.arange(rows)):
            if sorted(order.tolist()) != list(range(rows)):
                raise ValueError(f"{tensor.name}: its transform changes values, not rows; "
                                 "serve this file with --quantization none")
            value = value.take_rows(order)
        return value


def check_tensor_types(reader, file_name: str) -> None:
    """Refuse a file holding a tensor type the kernels do not read: its bytes
    would otherwise become wrong numbers."""
    supported = QUANT_TYPE_NAMES + FLOAT_TYPE_NAMES
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in supported:
            raise ValueError(f"{file_name}: tensor {tensor.name!r} is {tensor.tensor_type.name}, which "
                             f"pagedserve cannot read; supported types: {', '.join(supported)}")


def config_of(path):
    """The HF config transformers maps the file's metadata to."""
    from transformers import CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    return CONFIG_MAPPING[config.pop("model_type")].from_dict(config)


def load_gguf_tokenizer(path):
    """The file's tokenizer (and chat template), through transformers' GGUF path."""
    from transformers import AutoTokenizer

    path = Path(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _meta_model(hf_config):
    """The HF model of the config on the meta device: its parameter names, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"GGUF file has no {key!r}")
    return field.contents()
