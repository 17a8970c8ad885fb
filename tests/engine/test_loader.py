"""engine/model/models/loader.py: the default model's conversion and a model's sampling defaults."""

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.model.models.loader import (SAMPLING_KEYS, SMOLLM2_SAMPLING, convert_gguf,
                                  default_gguf_path, load_sampling_defaults)

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


def test_two_processes_converting_at_once_both_get_the_folder(tmp_path, smollm2_path):
    """Two servers starting together on a fresh cache must not fail on each other's output."""
    code = ("import sys; from pathlib import Path; "
            "from engine.model.models.loader import convert_gguf, default_gguf_path; "
            "print(convert_gguf(default_gguf_path(), Path(sys.argv[1])))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    children = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env,
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
    assert convert_gguf(default_gguf_path(), tmp_path) == folder
