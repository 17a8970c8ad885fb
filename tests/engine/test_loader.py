"""engine/model/models/loader.py: the default model's conversion and a model's sampling defaults."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import default_cache_dir
from engine.model.models import loader
from engine.model.models.loader import (DIGESTS_FILE, SAMPLING_KEYS, SMOLLM2_GGUF,
                                  SMOLLM2_SAMPLING, convert_gguf, default_gguf_path,
                                  gguf_digest, load_sampling_defaults)

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_model_carries_its_model_cards_sampling(smollm2_path):
    # The GGUF has no sampling metadata; the model card recommends these.
    assert load_sampling_defaults(smollm2_path) == SMOLLM2_SAMPLING


def test_sampling_defaults_read_only_sampling_keys(tmp_path):
    assert load_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": 20, "top_p": None, "eos_token_id": 2, "do_sample": True}))
    assert load_sampling_defaults(tmp_path) == {"temperature": 0.6, "top_k": 20}
    assert set(SAMPLING_KEYS) == {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}


def test_two_processes_converting_at_once_both_get_the_folder(tmp_path, tiny_gguf):
    """Two servers starting together on a fresh cache must not fail on each other's output."""
    gguf = tiny_gguf("llama")
    code = ("import sys; from pathlib import Path; "
            "from engine.model.models.loader import convert_gguf; "
            "print(convert_gguf(Path(sys.argv[2]), Path(sys.argv[1])))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    children = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(gguf)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(2)]
    results = [child.communicate(timeout=600) for child in children]
    for child, (out, err) in zip(children, results):
        assert child.returncode == 0, err[-2000:]
    folders = {out.strip() for out, _ in results}
    assert len(folders) == 1
    folder = Path(folders.pop())
    assert (folder / "config.json").exists()
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary left
    assert convert_gguf(gguf, tmp_path) == folder


def test_a_second_checkout_reuses_the_converted_folder(tmp_path, smollm2_path, monkeypatch):
    """The cache key is the file's content and the converter's version: the same GGUF
    at another path (a fresh clone, a reinstalled package) with another mtime loads
    the folder converted before, without converting again."""
    copy = tmp_path / "another-checkout" / SMOLLM2_GGUF
    copy.parent.mkdir()
    shutil.copyfile(default_gguf_path(), copy)
    os.utime(copy, (1_000_000_000, 1_000_000_000))

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    import transformers
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    assert convert_gguf(copy, default_cache_dir(), SMOLLM2_SAMPLING) == smollm2_path


def test_a_files_digest_is_read_once_per_path_size_and_mtime(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 100)
    digest = gguf_digest(gguf, tmp_path)
    assert json.loads((tmp_path / DIGESTS_FILE).read_text())[str(gguf.resolve())][2] == digest
    with monkeypatch.context() as patched:  # remembered: the bytes are not read again
        patched.setattr(loader.hashlib, "sha256", None)
        assert gguf_digest(gguf, tmp_path) == digest
    gguf.write_bytes(b"GGUF" + bytes(100))  # changed: hashed again
    assert gguf_digest(gguf, tmp_path) != digest
    with pytest.raises(FileNotFoundError):
        gguf_digest(tmp_path / "missing.gguf", tmp_path)


def test_a_gguf_folder_keeps_the_files_hf_names(tmp_path, tiny_gguf, monkeypatch):
    """A server starting from a direct folder reads the names mapped when the
    folder was made: mapping them again imports transformers' model classes,
    ~115 MB (generation, dynamo, triton) held for the process's life."""
    from engine.model.models import gguf_file

    path = tiny_gguf("qwen3", "Q8_0")
    folder = loader.gguf_folder(path, tmp_path)
    checkpoint = gguf_file.GGUFCheckpoint.open(path)
    assert json.loads((folder / loader.GGUF_NAMES).read_text()) == checkpoint.names
    expected = [name for name, _ in checkpoint.tensors()]

    def no_mapping(*args):
        raise AssertionError("mapped the names again")

    monkeypatch.setattr(gguf_file, "_name_map", no_mapping)
    assert [name for name, _ in loader.iter_checkpoint(folder)] == expected
    assert "model.layers.1.self_attn.q_norm.weight" in expected


def test_a_server_makes_a_files_folder_in_a_child_process(tmp_path, tiny_gguf):
    """`pagedserve serve` makes a GGUF file's folder before it loads, in a child
    process: the tokenizer's conversion imports transformers' GGUF modules
    (~240 MB resident for SmolLM2's), which the server must not hold for its
    life; a later start finds the folder and starts no child."""
    gguf = tiny_gguf("llama")
    code = ("import sys; from pathlib import Path; from engine.config import EngineConfig; "
            "from engine.model.model_info import prepare_model; "
            "prepare_model(EngineConfig(model=sys.argv[2], cache_dir=Path(sys.argv[1]))); "
            "print(sorted(m for m in sys.modules if m.startswith('transformers.integrations.ggml')))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(gguf)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"  # the conversion ran elsewhere
    (folder,) = [p for p in (tmp_path / "models").iterdir()]
    assert (folder / "config.json").exists() and folder.name.endswith(f"-direct{loader.DIRECT}")
    assert loader.resolve_model_path(str(gguf), tmp_path, dequantize=False) == folder


def test_a_child_that_cannot_make_the_folder_leaves_the_error_to_the_server(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(64))
    loader.prepare_model_path_apart(str(broken), tmp_path, dequantize=False)  # no raise here
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())
    with pytest.raises(Exception):
        loader.resolve_model_path(str(broken), tmp_path, dequantize=False)
