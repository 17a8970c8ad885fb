"""From a step's hidden states to each pooling request's vector.

A pooling model (engine/model/models/bert.py, decoder_pooling.py) returns the
last hidden state of every scheduled token, flat as every step lays them out.
Each sequence ends in the step that computes its prompt (the scheduler never
splits a pooling prompt), so its rows are all there:

    hidden   | s0 s0 s0 s0 | s1 s1 | s2 s2 s2 |
    CLS        first row          (BERT: the [CLS] token)
    LAST       last row           (decoders: the only token that saw them all)
    MEAN, MAX  over the rows

then a classifier runs its head on the pooled row (`model.classify`). What a
request may still change (normalise, truncate to `dimensions`, an activation)
is `finish`, applied to one vector on the host. Which pooling and whether to
normalise comes from the checkpoint's sentence-transformers files when it has
them (modules.json, 1_Pooling/config.json, config_sentence_transformers.json),
as `SentenceTransformer` reads them, else from the family's default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.errors import ValidationError
from engine.model.pooling.params import PoolingParams

POOLING_TYPES = ("CLS", "LAST", "MEAN", "MAX")
# 1_Pooling/config.json: `pooling_mode` (sentence-transformers 6) or one switch on
# (earlier versions), by the pooling each means.
ST_POOLING_MODES = {"cls": "CLS", "lasttoken": "LAST", "mean": "MEAN", "max": "MAX",
                    "pooling_mode_cls_token": "CLS", "pooling_mode_lasttoken": "LAST",
                    "pooling_mode_mean_tokens": "MEAN", "pooling_mode_max_tokens": "MAX"}
ST_MODULES = ("Transformer", "Pooling", "Normalize")  # the modules.json entries served


@dataclass(frozen=True)
class PoolingInfo:
    """What a pooling model answers, read once at start-up (the engine's `pooling`)."""

    task: str  # "embed" or "classify"
    size: int  # the embedding's width, or the number of labels
    pooling_type: str  # one of POOLING_TYPES
    normalize: bool  # embed: what a request gets unless it says
    causal: bool  # decoder attention: a prefix's K/V do not depend on what follows
    max_prompt_tokens: int  # the longest input it takes
    labels: tuple[str, ...] = ()  # classify: the label names, by index
    token_types: bool = False  # the model reads token_type_ids (BERT pairs)
    prompts: dict[str, str] = field(default_factory=dict)  # sentence-transformers' prompts
    # Inputs rendered as chat messages through the tokenizer's template, where the
    # checkpoint's sentence-transformers config says so (its "message" modality).
    chat_inputs: bool = False
    default_prompt: str = ""  # put before every input unless a request names another

    @property
    def prefix_cacheable(self) -> bool:
        """Whether cached prefix blocks may stand in for computed rows: only where
        the one pooled row is computed anyway and its K/V never see the future."""
        return self.causal and self.pooling_type == "LAST"


def read_pooling_info(model_path: Path | None, model, max_prompt_tokens: int) -> PoolingInfo:
    """The model's PoolingInfo: its class's defaults, then its sentence-transformers files."""
    classify = getattr(model, "num_labels", None) is not None
    folder = Path(model_path) if model_path is not None and Path(model_path).is_dir() else None
    pooling, normalize = model.DEFAULT_POOLING, not classify
    prompts, default_prompt, chat_inputs = {}, "", False
    if folder is not None and (folder / "modules.json").is_file():
        pooling, normalize, limit, chat_inputs = _read_st_modules(folder, pooling)
        max_prompt_tokens = min(max_prompt_tokens, limit or max_prompt_tokens)
        prompts, default_prompt = _read_st_prompts(folder)
    return PoolingInfo(
        task="classify" if classify else "embed",
        size=model.num_labels if classify else model.args.hidden_size,
        pooling_type=pooling, normalize=normalize, causal=model.CAUSAL,
        max_prompt_tokens=max_prompt_tokens, labels=tuple(getattr(model, "labels", ())),
        token_types=bool(getattr(model, "token_types", False)), prompts=prompts,
        default_prompt=default_prompt, chat_inputs=chat_inputs)


def _read_st_modules(folder: Path, pooling: str) -> tuple[str, bool, int | None, bool]:
    """(pooling, normalize, max_seq_length, chat inputs) from modules.json and the
    modules' folders; a module this engine does not run (Dense, ...) is refused."""
    normalize, limit, chat = False, None, False
    for module in json.loads((folder / "modules.json").read_text()):
        kind = module["type"].rsplit(".", 1)[-1]
        if kind not in ST_MODULES:
            raise ValueError(f"{folder.name}: sentence-transformers module {kind!r} is not "
                             f"supported (served: {', '.join(ST_MODULES)})")
        path = folder / module.get("path", "")
        if kind == "Pooling":
            pooling = _read_st_pooling(path / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif (path / "sentence_bert_config.json").is_file():
            config = json.loads((path / "sentence_bert_config.json").read_text())
            limit = config.get("max_seq_length")
            chat = "message" in (config.get("modality_config") or {})
    return pooling, normalize, limit, chat


def _read_st_pooling(config_file: Path) -> str:
    config = json.loads(config_file.read_text())
    named = config.get("pooling_mode")
    keys = [named] if isinstance(named, str) else [
        key for key, on in config.items() if on is True and key.startswith("pooling_mode_")]
    modes = [ST_POOLING_MODES.get(key) for key in keys]
    if len(modes) != 1 or None in modes:
        raise ValueError(f"{config_file}: pooling {keys} is not supported: one of "
                         f"cls, lasttoken, mean, max, alone")
    if config.get("include_prompt", True) is False:
        raise ValueError(f"{config_file}: include_prompt=false is not supported")
    return modes[0]


def _read_st_prompts(folder: Path) -> tuple[dict[str, str], str]:
    file = folder / "config_sentence_transformers.json"
    config = json.loads(file.read_text()) if file.is_file() else {}
    prompts = {str(k): str(v) for k, v in (config.get("prompts") or {}).items()}
    return prompts, prompts.get(config.get("default_prompt_name") or "", "")


def pool(hidden: torch.Tensor, spans: list[tuple[int, int]], pooling_type: str) -> torch.Tensor:
    """[len(spans), hidden] in float32: each (start, length) run of rows pooled."""
    rows = []
    for start, length in spans:
        part = hidden[start:start + length]
        if pooling_type == "CLS":
            rows.append(part[0])
        elif pooling_type == "LAST":
            rows.append(part[-1])
        elif pooling_type == "MEAN":
            rows.append(part.float().mean(dim=0))
        else:
            rows.append(part.max(dim=0).values)
    return torch.stack([row.float() for row in rows])


def check_params(params: PoolingParams, info: PoolingInfo) -> None:
    """Refuse what this model cannot answer, naming the field."""
    task = params.task or info.task
    wanted = "classify" if task == "score" else task
    if wanted != info.task:
        raise ValidationError(f"this model answers {info.task!r} requests, not {task!r}", "task")
    if task == "score" and info.size != 1:
        raise ValidationError(f"scoring needs a classifier with one label; this one has "
                              f"{info.size}", "task")
    if params.dimensions is not None and (task != "embed" or params.dimensions > info.size):
        raise ValidationError(f"dimensions must be at most the embedding size {info.size} "
                              f"(embeddings only), got {params.dimensions}", "dimensions")


def finish(data: torch.Tensor, params: PoolingParams, info: PoolingInfo) -> torch.Tensor:
    """The request's answer from the model's pooled row (float32, on the host)."""
    task = params.task or info.task
    if task == "embed":
        if params.dimensions is not None:
            data = data[:params.dimensions]
        normalize = info.normalize if params.normalize is None else params.normalize
        return F.normalize(data, dim=-1) if normalize else data
    if params.use_activation is False:
        return data
    if task == "score" or data.numel() == 1:
        return torch.sigmoid(data)
    return torch.softmax(data, dim=-1)
