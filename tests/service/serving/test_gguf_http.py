"""A GGUF file served over HTTP as it is: `pagedserve serve --model file.gguf`
implies --quantization gguf and streams the same greedy tokens as the
offline engine on the file."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from live_server import run_server, tiny_config

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_gguf_file_streams_the_offline_engines_tokens(tiny_gguf):
    path = tiny_gguf("qwen3", "Q4_K_M")
    prompt = [5, 17, 300, 42, 9, 1000, 77]
    offline = LLM(str(path), max_model_len=256, kv_cache_memory_bytes=64 << 20, dtype="bfloat16")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = offline.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    del offline
    with run_server(tiny_config(path, engine={"dtype": "bfloat16"})) as live:
        assert live.engine.config.quantization == "gguf"
        with live.client() as client:
            body = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                        ignore_eos=True)
            text = ""
            with client.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                for line in reply.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += json.loads(line[6:])["choices"][0]["text"]
    assert text == expected.outputs[0].text
