"""KV events the way vLLM publishes them (engine/core/kv_events.py): the
publisher binds its endpoint (loopback, every interface, ipc) and subscribers
connect; a DEALER asking the replay endpoint "from sequence N" gets the
buffered batches from N on, byte for byte as they went out live, then the end
marker; the knobs and their checks; and salted tenants' events, which an
index keyed the way vllm-router keys it never credits to another tenant."""

from __future__ import annotations

import argparse
import hashlib
import time

import msgspec
import pytest
import zmq

from engine.args import add_engine_args
from engine.config import EngineConfig
from engine.core.block_hash import salt_digest
from engine.core.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    KVEventPublisher,
    stored_events,
    tenant_tag,
)
from engine.core.sequence import Sequence
from engine.frontend.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

RECV_MS = 5000  # the longest wait for one message: a lost reply fails, it does not hang
TOPIC = b"kv@pod@tiny"


def connected(kind: int, endpoint: str, **options) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.RCVTIMEO, RECV_MS)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(endpoint)
    return sock


def publish_until_received(publisher: KVEventPublisher, sub: zmq.Socket) -> list[bytes]:
    """PUB drops what it sends before the subscription arrives: publish until a
    batch gets through, then take what followed it; the frames of the last one."""
    deadline = time.monotonic() + 10
    while not sub.poll(100):
        assert time.monotonic() < deadline, "the subscriber never received anything"
        publisher.publish([AllBlocksCleared()])
    frames = sub.recv_multipart()
    while sub.poll(300):
        frames = sub.recv_multipart()
    return frames


@pytest.mark.parametrize("endpoint, host", [
    ("tcp://127.0.0.1:*", "tcp://127.0.0.1:"), ("tcp://*:*", "tcp://0.0.0.0:"), ("ipc://", "ipc://"),
])
def test_the_endpoint_is_bound_and_a_subscriber_connects(endpoint, host, tmp_path):
    if endpoint == "ipc://":
        endpoint = f"ipc://{tmp_path}/events.sock"
    publisher = KVEventPublisher(endpoint, topic=TOPIC.decode())
    bound = publisher.bound.replace("0.0.0.0", "127.0.0.1")  # every interface: loopback too
    sub = connected(zmq.SUB, bound, SUBSCRIBE=b"")
    try:
        assert publisher.bound.startswith(host)
        topic, seq, payload = publish_until_received(publisher, sub)
        assert topic == TOPIC and len(seq) == 8
        assert msgspec.msgpack.decode(payload)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        sub.close()
        publisher.close()


def test_an_endpoint_in_use_fails_at_start_up():
    first = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    try:
        with pytest.raises(ValueError, match="kv_events_endpoint='tcp://127.0.0.1:"):
            KVEventPublisher(first.bound)
        with pytest.raises(ValueError, match="kv_events_replay_endpoint='tcp://127.0.0.1:"):
            KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint=first.replay_bound)
    finally:
        first.close()


def replay(dealer: zmq.Socket, start: int) -> list[tuple[int, bytes]]:
    """Ask for the batches from `start` on, as vllm-router's DEALER asks: (seq, payload)
    of each reply up to the end marker, checking every frame on the way."""
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replies = []
    while True:
        frames = dealer.recv_multipart()
        assert len(frames) == 4 and frames[0] == b"", frames
        topic, seq, payload = frames[1:]
        if seq == END_SEQ:
            assert (topic, payload) == (b"", b"")
            assert int.from_bytes(seq, "big", signed=True) == -1
            return replies
        assert topic == TOPIC
        replies.append((int.from_bytes(seq, "big"), payload))


def test_replay_sends_the_buffered_batches_from_the_number_asked_for():
    publisher = KVEventPublisher("tcp://127.0.0.1:*", topic=TOPIC.decode(),
                                 replay_endpoint="tcp://127.0.0.1:*", buffer_steps=4)
    sub = connected(zmq.SUB, publisher.bound, SUBSCRIBE=b"")
    dealer = connected(zmq.DEALER, publisher.replay_bound)
    try:
        first = int.from_bytes(publish_until_received(publisher, sub)[1], "big")
        live = {}
        for i in range(6):  # six more: the buffer keeps the last four
            publisher.publish([AllBlocksCleared()] * (i + 1))
            _, seq, payload = sub.recv_multipart()
            live[int.from_bytes(seq, "big")] = payload
        last = first + 6
        assert sorted(live) == list(range(first + 1, last + 1))
        assert replay(dealer, last - 1) == [(n, live[n]) for n in (last - 1, last)]
        assert replay(dealer, 0) == [(n, live[n]) for n in range(last - 3, last + 1)]
        assert replay(dealer, last + 1) == []  # nothing yet: only the end marker
        # A malformed request is dropped; the next one is answered.
        dealer.send_multipart([b"", b"not eight bytes"])
        assert not dealer.poll(300)
        assert [seq for seq, _ in replay(dealer, last)] == [last]
    finally:
        sub.close()
        dealer.close()
        publisher.close()


def test_a_replay_client_connecting_later_still_gets_the_buffer():
    """A restarted router connects after the batches went out, to no subscriber at all."""
    publisher = KVEventPublisher("tcp://127.0.0.1:*", topic=TOPIC.decode(),
                                 replay_endpoint="tcp://127.0.0.1:*")
    for i in range(3):
        publisher.publish([AllBlocksCleared()])
    dealer = connected(zmq.DEALER, publisher.replay_bound)
    try:
        deadline = time.monotonic() + 10
        while len(batches := replay(dealer, 0)) < 3:  # the thread may not have sent all yet
            assert time.monotonic() < deadline
        assert [seq for seq, _ in batches] == [0, 1, 2]
        assert msgspec.msgpack.decode(batches[0][1])[1] == [{"type": "AllBlocksCleared"}]
    finally:
        dealer.close()
        publisher.close()


# -- the knobs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, message", [
    ({"kv_events_replay_endpoint": "tcp://127.0.0.1:5558"}, "needs kv_events_endpoint"),
    ({"kv_events_endpoint": "tcp://*:5557", "kv_events_replay_endpoint": "tcp://*:5557"},
     "must differ"),
    ({"kv_events_endpoint": "tcp://*:5557", "kv_events_replay_endpoint": "5558"},
     "kv_events_replay_endpoint='5558' must start with tcp://"),
    ({"kv_events_buffer_steps": 0}, "kv_events_buffer_steps=0 must be >= 1"),
])
def test_config_refuses_a_replay_it_cannot_serve(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_the_flags_follow_the_fields():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-events-endpoint", "tcp://127.0.0.1:5557",
                              "--kv-events-replay-endpoint", "tcp://127.0.0.1:5558",
                              "--kv-events-buffer-steps", "64"])
    assert (args.kv_events_endpoint, args.kv_events_replay_endpoint,
            args.kv_events_buffer_steps) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", 64)
    assert parser.parse_args([]).kv_events_buffer_steps == 10_000  # vLLM's buffer_steps


# -- tenants ------------------------------------------------------------------------------------
def router_keys(events: list[dict]) -> dict[bytes, tuple]:
    """What vllm-router's kv_aware index makes of BlockStored events (checked
    against vllm-router 0.1.17): each block's key is SHA-256 of its tokens
    (u32 little-endian) seeded with the event's lora_name, and a block sits
    under its parent, so a block's place is the path of keys from the root.
    Returns {block hash: path}."""
    paths: dict[bytes, tuple] = {}
    for event in events:
        size, seed = event["block_size"], (event["lora_name"] or "").encode()
        path = paths[event["parent_block_hash"]] if event["parent_block_hash"] else ()
        for i, block_hash in enumerate(event["block_hashes"]):
            tokens = event["token_ids"][i * size:(i + 1) * size]
            path += (hashlib.sha256(seed + b"".join(t.to_bytes(4, "little")
                                                    for t in tokens)).digest(),)
            paths[block_hash] = path
    return paths


def credited_blocks(paths: dict[bytes, tuple], prompt: list[int], size: int) -> int:
    """The blocks of `prompt` such an index credits: a request has no lora_name,
    and the router asks the worker's render endpoint for its tokens only."""
    held = set(paths.values())
    path: tuple = ()
    for i in range(len(prompt) // size):
        block = prompt[i * size:(i + 1) * size]
        path += (hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in block)).digest(),)
        if path not in held:
            return i
    return len(prompt) // size


def test_a_salted_sequence_names_its_tenant_in_every_event():
    salt = salt_digest("tenant-a\0")
    seq = Sequence(0, "r", 0, list(range(100, 117)), SamplingParams(), cache_salt=salt)
    first, later = stored_events([0, 1, 3], [bytes([i]) * 32 for i in range(4)], 4,
                                 seq.token_slice, seq.cache_salt)
    tag = tenant_tag(salt)
    assert tag.startswith("salt:") and salt.hex()[:8] not in tag
    assert (first.lora_name, first.extra_keys) == (tag, [(tag,), None])
    assert (later.lora_name, later.extra_keys) == (tag, None)  # no chain start: no extra keys
    plain = Sequence(1, "s", 0, list(range(100, 117)), SamplingParams())
    assert [e.lora_name for e in stored_events([0, 3], [b"h" * 32] * 4, 4, plain.token_slice,
                                                    plain.cache_salt)] \
        == [None, None]
    assert tenant_tag(b"") is None and tenant_tag(salt) != tenant_tag(salt_digest("tenant-b\0"))


def test_tenants_blocks_never_match_another_tenants_request(tiny_llama_path, single_thread):
    engine = LLMEngine(EngineConfig(
        model=str(tiny_llama_path), dtype="float32", block_size=8, max_model_len=64,
        num_gpu_blocks_override=24, kv_events_endpoint="inproc://kv-events-tenants"))
    prompt = list(range(1000, 1027))  # three full blocks and three tokens
    params = SamplingParams(temperature=0, max_tokens=1)
    published: list = []
    engine.kv_events.publish = published.extend  # the batches, before they go out
    try:
        for request_id, salt in (("a", "tenant-a\0"), ("b", "tenant-b\0"), ("a2", "tenant-a\0")):
            engine.add_request(request_id, prompt, params, cache_salt=salt)
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.close()
    events = msgspec.msgpack.decode(msgspec.msgpack.encode(published))  # as a router reads them
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert len(stored) == 2, "tenant a's second request hit its own blocks"
    assert [e["lora_name"] for e in stored] == [tenant_tag(salt_digest(s))
                                                for s in ("tenant-a\0", "tenant-b\0")]
    assert [e["token_ids"] for e in stored] == [prompt[:24]] * 2
    paths = router_keys(stored)
    assert len(set(paths.values())) == 6  # same tokens, two tenants: disjoint index entries
    assert credited_blocks(paths, prompt, 8) == 0
    # The same prompt unsalted is indexed where a request finds it.
    unsalted = dict(stored[0], lora_name=None, block_hashes=[b"u%d" % i for i in range(3)])
    assert credited_blocks(router_keys(stored + [unsalted]), prompt, 8) == 3
