"""KV cache events from a real server (--kv-events-endpoint on ipc://, which the
server binds): a completion's prompt blocks arrive as BlockStored with the
hashes the engine computes, a chat's chain checks out, POST
/reset_prefix_cache arrives as AllBlocksCleared, stopping the server
stops the publisher, and each API key's blocks name its tenant. Decoded with
plain msgspec, not our structs."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from engine.core.block_hash import ROOT_HASH, hash_block
from live_server import LiveServer, run_server, tiny_config

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCK = 16  # tiny_config's block size: EngineConfig's default
TOPIC = b"kv@pod-0@tiny"
RECV_MS = 10_000  # the longest wait for one message: a lost event fails, it does not hang


@pytest.fixture(scope="module")
def served(tiny_llama_path, tmp_path_factory) -> Iterator[tuple[LiveServer, zmq.Socket]]:
    endpoint = f"ipc://{tmp_path_factory.mktemp('kv')}/events.sock"
    config = tiny_config(tiny_llama_path, engine={"kv_events_endpoint": endpoint,
                                                  "kv_events_topic": TOPIC.decode()})
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.setsockopt(zmq.RCVTIMEO, RECV_MS)
    sub.setsockopt(zmq.LINGER, 0)
    try:
        with run_server(config) as live:
            sub.connect(endpoint)
            handshake(live, sub)
            yield live, sub
        assert not live.engine.kv_events._thread.is_alive(), "shutdown left the publisher running"
    finally:
        sub.close()


def handshake(live: LiveServer, sub: zmq.Socket, headers: dict | None = None) -> None:
    """PUB drops what it sends before the subscription arrives (the slow joiner):
    reset until an AllBlocksCleared gets through, then drop what came so far."""
    deadline = time.monotonic() + 20
    with live.client(headers=headers) as http:
        while not sub.poll(200):
            assert time.monotonic() < deadline, "the subscriber never received anything"
            http.post("/reset_prefix_cache").raise_for_status()
    drain(sub)


def drain(sub: zmq.Socket) -> None:
    while sub.poll(300):
        sub.recv_multipart()


def events_until(sub: zmq.Socket, kind: str) -> list[dict]:
    """The events of the batches received up to the first with a `kind` event."""
    events: list[dict] = []
    while not any(event["type"] == kind for event in events):
        topic, seq, payload = sub.recv_multipart()
        batch = msgspec.msgpack.decode(payload)
        assert topic == TOPIC and len(seq) == 8
        assert isinstance(batch, list) and isinstance(batch[0], float) and batch[2] == 0
        events += batch[1]
    return events


def chain(tokens: list[int], extra: bytes) -> list[bytes]:
    """The engine's hashes, recomputed: SHA-256 chain from the root, no salt."""
    hashes, parent = [], ROOT_HASH
    for i in range(len(tokens) // BLOCK):
        parent = hash_block(parent, tokens[i * BLOCK:(i + 1) * BLOCK], extra)
        hashes.append(parent)
    return hashes


def test_a_completion_publishes_its_prompt_blocks(served):
    live, sub = served
    rng = random.Random(11)
    prompt = [rng.randrange(3, 49152) for _ in range(3 * BLOCK + 5)]
    with live.client() as http:
        response = http.post("/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    stored = [e for e in events_until(sub, "BlockStored") if e["type"] == "BlockStored"]
    assert stored == [{
        "type": "BlockStored", "block_hashes": chain(prompt, live.engine.fingerprint),
        "parent_block_hash": None, "token_ids": prompt[:3 * BLOCK], "block_size": BLOCK,
        "lora_id": None, "medium": "GPU", "lora_name": None,
    }]
    drain(sub)


def test_a_chat_publishes_a_chain_that_hashes_back(served):
    """The rendered chat prompt is the server's to know: its events must carry
    tokens whose hashes are the ones announced, block after block."""
    live, sub = served
    with live.client() as http:
        response = http.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me about paged KV caches. " * 4}]})
    assert response.status_code == 200, response.text
    stored = [e for e in events_until(sub, "BlockStored") if e["type"] == "BlockStored"]
    tokens = [t for event in stored for t in event["token_ids"]]
    hashes = [h for event in stored for h in event["block_hashes"]]
    assert stored[0]["parent_block_hash"] is None and len(hashes) >= 2
    assert hashes == chain(tokens, live.engine.fingerprint)
    assert len(tokens) == len(hashes) * BLOCK <= response.json()["usage"]["prompt_tokens"]
    drain(sub)


def test_reset_prefix_cache_publishes_all_blocks_cleared(served):
    live, sub = served
    with live.client() as http:
        assert http.post("/reset_prefix_cache").status_code == 200
    assert events_until(sub, "AllBlocksCleared") == [{"type": "AllBlocksCleared"}]


def test_each_api_keys_blocks_name_their_tenant(tiny_llama_path, tmp_path):
    """Two tenants (API keys) send the same prompt: two chains of the same
    tokens, each named by its tenant's tag (engine/core/kv_events.py,
    tenant_tag), which a router hashes in; a tenant's repeat is a cache hit."""
    endpoint = f"ipc://{tmp_path}/events.sock"
    config = tiny_config(tiny_llama_path, engine={"kv_events_endpoint": endpoint,
                                                  "kv_events_topic": TOPIC.decode()},
                         api_keys=("key-a", "key-b"), admin_keys=("admin",))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, RECV_MS)
    sub.setsockopt(zmq.LINGER, 0)
    prompt = [random.Random(12).randrange(3, 49152) for _ in range(2 * BLOCK + 3)]
    try:
        with run_server(config) as live:
            sub.connect(endpoint)
            handshake(live, sub, headers={"Authorization": "Bearer admin"})
            stored = []
            for key in ("key-a", "key-b", "key-a"):
                with live.client(headers={"Authorization": f"Bearer {key}"}) as http:
                    response = http.post("/v1/completions", json={
                        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
                assert response.status_code == 200, response.text
                if key == "key-b" or not stored:
                    stored += [e for e in events_until(sub, "BlockStored")
                               if e["type"] == "BlockStored"]
            assert not sub.poll(500), "tenant a's repeat cached new blocks"
    finally:
        sub.close()
    assert [e["token_ids"] for e in stored] == [prompt[:2 * BLOCK]] * 2
    tags = [e["lora_name"] for e in stored]
    assert all(tag and tag.startswith("salt:") for tag in tags) and tags[0] != tags[1]
    assert [e["extra_keys"] for e in stored] == [[[tag], None] for tag in tags]
    assert stored[0]["block_hashes"] != stored[1]["block_hashes"]
