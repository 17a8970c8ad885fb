"""Fixtures: live servers on the tiny random Llama and on the real SmolLM2."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.config import EngineConfig
from live_server import LiveServer, run_server, tiny_config
from service.config import ServiceConfig


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_path) -> Iterator[LiveServer]:
    with run_server(tiny_config(tiny_llama_path)) as live:
        yield live


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path) -> Iterator[LiveServer]:
    # De-quantized (float32): these modules hold the service to batching
    # invariance (a request alone = in a batch = streamed), which float weights
    # keep and the file's blocks do not (up to 7 tokens a call multiply with
    # 8-bit activations, more with bf16 strips); the blocks are served over
    # HTTP in tests/service/serving/test_gguf_http.py.
    engine = EngineConfig(model="smollm2-135m-instruct", max_model_len=2048,
                          kv_cache_memory_bytes=256 << 20, dtype="float32", quantization="none")
    with run_server(ServiceConfig(engine=engine)) as live:
        yield live


