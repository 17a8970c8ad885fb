"""A GGUF file read in place: its HF config, and its tensors under HF names, quantized ones as stored.

    checkpoint = GGUFCheckpoint.open(path)     # metadata and tensor index only
    checkpoint.config                          # the HF PretrainedConfig
    for name, value in checkpoint.tensors():   # "model.layers.0.self_attn.q_proj.weight", ...
        ...                                    # torch.Tensor (F32/F16/BF16) or QuantTensor

The file is memory-mapped (gguf.GGUFReader): a QuantTensor's bytes are a
view of the mapping, read from disk only when something touches them.

Names and values are what transformers' GGUF loader gives
(transformers/modeling_gguf_pytorch_utils.py): its GGUF -> HF name map, and
its per-architecture TensorProcessor, whose transforms (Llama's q/k row
permutation, Gemma's norms stored as 1 + w) apply to quantized tensors only
when they move whole rows. Expert tensors ([E, rows, cols] in the file) come
one expert at a time, "model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight".

The config is transformers' mapping of the metadata (load_gguf_checkpoint),
completed where that mapping drops keys our model classes read (see
gguf_config.py); a file we cannot serve is refused at open, naming why.

`checkpoint.index()` is what the reader found, as JSON: each tensor's name,
type, offset and array shape, and the two fields read later. A model folder
keeps it, and `open(path, config, names, index)` then maps the file without
gguf.GGUFReader, whose parse of every metadata field walks the tokenizer's
~98k strings one numpy view at a time (6.4 s for SmolLM2's file on a
first-generation EPYC core, every time a server or a rank started).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.model.models.gguf_config import hf_config_dict, make_config

SUPPORTED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")
# The metadata fields read after open (architecture, chat_template), kept in the index.
INDEX_FIELDS = ("general.architecture", "tokenizer.chat_template")
_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


@dataclass(frozen=True)
class QuantTensor:
    """A quantized [rows, cols] matrix as the file stores it: `data` is uint8
    [rows, row_bytes], each row its cols values in whole blocks of `type_name`.
    Rows are independent, so they can be selected and reordered as bytes."""

    type_name: str
    data: torch.Tensor
    shape: tuple[int, int]

    def take_rows(self, index) -> "QuantTensor":
        """These rows (a sequence or tensor of row indices), in this order."""
        index = torch.as_tensor(index, dtype=torch.long)
        return QuantTensor(self.type_name, self.data[index], (int(index.numel()), self.shape[1]))

    def rows(self, start: int, stop: int) -> "QuantTensor":
        """Rows start..stop-1: a view, no copy."""
        data = self.data[start:stop]
        return QuantTensor(self.type_name, data, (int(data.shape[0]), self.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols] (gguf.quants, through kernels/quant.py; reads the bytes)."""
        from kernels.quant import dequantize_part

        return dequantize_part(self.type_name, self.data).reshape(self.shape)


@dataclass(frozen=True)
class _Entry:
    """One file tensor and what becomes of it: its HF name (the stem of the
    per-expert names for expert tensors) and the row order transformers gives it."""

    gguf_name: str
    hf_name: str
    tensor: object  # gguf ReaderTensor
    rows: torch.Tensor | None  # a permutation of the rows, None: as stored
    values_change: bool  # transformers changes values (float tensors only)


class GGUFCheckpoint:
    """An open GGUF file of an architecture we serve (see `open`)."""

    def __init__(self, path: Path, mapping: np.ndarray, fields: dict, config_dict: dict, config,
                 processor, names: dict[str, str], entries: list[_Entry]) -> None:
        self.path = path
        self.mapping = mapping  # the whole file, memory-mapped read-only: tensors view it
        self.fields = fields  # INDEX_FIELDS: the metadata read after open
        self.config_dict = config_dict  # transformers' key names, as the processors read them
        self.config = config
        self.processor = processor
        self.names = names  # GGUF tensor name -> HF name (_name_map), experts aside
        self.entries = entries

    @classmethod
    def open(cls, path, config=None, names: dict[str, str] | None = None,
             index: dict | None = None) -> "GGUFCheckpoint":
        """Read the metadata and the tensor index (not the tensor bytes).
        `config`: the file's HF config when already known (a model folder's
        config.json, written from it): mapping the metadata again reads the
        whole file's fields a second time (~3 s for SmolLM2's tokenizer).
        `names`: the file's `names` when already known (a model folder keeps
        them): mapping them builds transformers' model class, whose import
        chain (generation, dynamo, triton) holds ~115 MB for the process's life.
        `index`: the file's `index()` when already known (a model folder
        keeps it, beside `config` and `names`): the file is mapped without
        parsing its metadata.

        ValueError: an architecture we do not serve; a tensor of a type we do
        not take, one that no HF weight takes, or a transform that cannot be
        applied to its quantized rows."""
        import gguf
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        path = Path(path)
        if index is not None and config is not None:
            mapping = np.memmap(path, dtype=np.uint8, mode="r")
            fields, tensors = index["fields"], _mapped_tensors(mapping, index["tensors"])
        else:
            reader = gguf.GGUFReader(str(path))
            mapping, tensors = reader.data, reader.tensors
            fields = {key: _field(reader, key) for key in INDEX_FIELDS}
        if config is None:
            config_dict = hf_config_dict(path, reader)
            config = make_config(config_dict)
        else:
            config_dict = config.to_dict()
        architecture = fields["general.architecture"]
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config_dict)
        _check_types(tensors)
        if names is None:
            names = _name_map(config, architecture)
        entries = [_plan(tensor, names, processor) for tensor in tensors]
        return cls(path, mapping, fields, config_dict, config, processor, names, entries)

    def index(self) -> dict:
        """What open read from the file, as JSON (see the module docstring)."""
        tensors = [{"name": e.tensor.name, "type": e.tensor.tensor_type.name,
                    "shape": [int(n) for n in e.tensor.shape.tolist()],
                    "offset": int(e.tensor.data_offset), "dtype": e.tensor.data.dtype.str,
                    "array_shape": list(e.tensor.data.shape)} for e in self.entries]
        return {"fields": self.fields, "tensors": tensors}

    @property
    def architecture(self) -> str:
        """The file's general.architecture (llama.cpp's name: "llama", "qwen3moe", ...)."""
        return self.fields["general.architecture"]

    @property
    def chat_template(self) -> str | None:
        return self.fields["tokenizer.chat_template"]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """(HF name, value): float tensors as torch tensors of their stored dtype
        (float32 where transformers changes their values), quantized ones as
        QuantTensor viewing the file's bytes."""
        for entry in self.entries:
            value = _stored(entry.tensor)
            if entry.values_change:  # only float tensors get here (checked at open)
                value = self._transformed(entry, value.float().numpy())
            elif entry.rows is not None:
                value = value.take_rows(entry.rows) if isinstance(value, QuantTensor) \
                    else value[entry.rows]
            yield from _split_experts(entry, value)

    def dequantized_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as float32, as transformers' GGUF loader computes it:
        gguf.quants.dequantize, then the architecture's TensorProcessor."""
        import gguf

        for entry in self.entries:
            values = gguf.quants.dequantize(entry.tensor.data, entry.tensor.tensor_type)
            yield from _split_experts(entry, self._transformed(entry, values))

    def _transformed(self, entry: _Entry, values: np.ndarray) -> torch.Tensor:
        if _EXPERTS.match(entry.gguf_name) is None:
            values = self.processor.process(weights=values, name=entry.gguf_name).weights
        return torch.from_numpy(np.copy(values)).reshape(_hf_shape(entry.tensor))


def load_gguf_tokenizer(path):
    """The file's tokenizer, rebuilt by transformers from its metadata."""
    from transformers import AutoTokenizer

    path = Path(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


@dataclass(frozen=True)
class _MappedTensor:
    """A tensor found through an index: the attributes of gguf's ReaderTensor
    that this module reads, `data` the same view of the same mapped bytes."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order, innermost first
    data_offset: int
    data: np.ndarray


def _mapped_tensors(mapping: np.ndarray, records: list[dict]) -> list[_MappedTensor]:
    """The index's tensors as views of the file's mapping."""
    import gguf

    tensors = []
    for record in records:
        dtype = np.dtype(record["dtype"])
        size = dtype.itemsize * int(np.prod(record["array_shape"], dtype=np.int64))
        data = mapping[record["offset"]:record["offset"] + size].view(dtype)
        tensors.append(_MappedTensor(record["name"], gguf.GGMLQuantizationType[record["type"]],
                                     np.array(record["shape"], dtype=np.uint64),
                                     record["offset"], data.reshape(record["array_shape"])))
    return tensors


def _check_types(tensors) -> None:
    for tensor in tensors:
        type_name = tensor.tensor_type.name
        if type_name not in SUPPORTED_TYPES + FLOAT_TYPES:
            raise ValueError(f"tensor {tensor.name!r} is of type {type_name}, which is not "
                             f"supported; supported: {', '.join(SUPPORTED_TYPES + FLOAT_TYPES)}")


def _name_map(config, architecture: str) -> dict[str, str]:
    """GGUF tensor name -> HF name: transformers' rule (get_gguf_hf_weights_map:
    gguf-py's TensorNameMap applied to each name of the model's state dict,
    built on the meta device), without its descent into every submodule,
    which maps nothing more for these families and takes seconds on a
    30-layer model. Expert tensors are mapped by _EXPERTS, not here."""
    import gguf
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == architecture)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    mapping = {}
    for hf_name in model.state_dict():
        stem, suffix = hf_name, ""
        if hf_name.endswith((".weight", ".bias")):
            stem, suffix = hf_name.rsplit(".", 1)
            suffix = "." + suffix
        gguf_name = names.get_name(stem)
        if gguf_name is not None:
            mapping[gguf_name + suffix] = hf_name
    return mapping


def _plan(tensor, names: dict[str, str], processor) -> _Entry:
    """Where a file tensor goes and how transformers transforms it; refuses the undoable."""
    name = tensor.name
    experts = _EXPERTS.match(name)
    if experts:
        return _Entry(name, f"model.layers.{experts.group(1)}.mlp.experts", tensor, None, False)
    hf_name = names.get(name)
    if hf_name is None:
        raise ValueError(f"tensor {name!r} has no place in the HF model "
                         f"({tensor.tensor_type.name}, shape {_hf_shape(tensor)}); "
                         f"the file cannot be served as it is")
    # transformers' processor applied to a column of row numbers shows what it
    # does: nothing, a reordering of whole rows, or a change of values.
    shape = _hf_shape(tensor)
    probe = np.arange(shape[0], dtype=np.float64).reshape(shape[0], *([1] * (len(shape) - 1)))
    result = np.asarray(processor.process(weights=probe, name=name).weights).reshape(-1)
    if np.array_equal(result, probe.reshape(-1)):
        return _Entry(name, hf_name, tensor, None, False)
    if np.array_equal(np.sort(result), probe.reshape(-1)):
        return _Entry(name, hf_name, tensor, torch.from_numpy(result.astype(np.int64)), False)
    if tensor.tensor_type.name not in FLOAT_TYPES:
        raise ValueError(f"tensor {name!r} ({tensor.tensor_type.name}): transformers changes "
                         f"its values, which cannot be done to quantized rows")
    return _Entry(name, hf_name, tensor, None, True)


def _hf_shape(tensor) -> tuple[int, ...]:
    """GGUF lists dimensions innermost first; torch, outermost first."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def _stored(tensor) -> torch.Tensor | QuantTensor:
    """A zero-copy torch view of the mapped bytes (float) or a QuantTensor."""
    type_name, shape = tensor.tensor_type.name, _hf_shape(tensor)
    with warnings.catch_warnings():
        # The mapping is read-only and torch warns it cannot promise that;
        # nothing here writes into it.
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(tensor.data)
    if type_name == "BF16":
        return data.view(torch.uint8).view(torch.bfloat16).reshape(shape)
    if type_name in FLOAT_TYPES:
        return data.reshape(shape)
    data = data.reshape(*shape[:-1], -1)  # [..., rows, row_bytes]
    if data.dim() == 2:
        return QuantTensor(type_name, data, (shape[0], shape[1]))
    return _ExpertStack(type_name, data, shape)


@dataclass(frozen=True)
class _ExpertStack:
    """An expert tensor of the file: [E, rows, row_bytes], handed out one expert at a time."""

    type_name: str
    data: torch.Tensor
    shape: tuple[int, ...]

    def expert(self, index: int) -> QuantTensor:
        return QuantTensor(self.type_name, self.data[index], (self.shape[1], self.shape[2]))


def _split_experts(entry: _Entry, value) -> Iterator[tuple[str, object]]:
    match = _EXPERTS.match(entry.gguf_name)
    if match is None:
        yield entry.hf_name, value
        return
    for expert in range(entry.tensor.shape.tolist()[-1]):
        part = value.expert(expert) if isinstance(value, _ExpertStack) else value[expert]
        yield f"{entry.hf_name}.{expert}.{match.group(2)}_proj.weight", part
