"""KV cache events (engine/core/kv_events.py): the block manager's event log with
exact block ids and exact events (stored runs and their parents, evictions,
resets, events off), a scheduler fuzz that replays the events into an index
and holds it equal to the cache, the publisher's frames and sequence numbers,
and the tiny model end to end through a real ZMQ SUB socket, decoded without
our own structs. Binding, replay and tenants: test_kv_events_replay.py."""

from __future__ import annotations

import queue
import random
import time

import msgspec
import pytest
import zmq

from engine.core.block_hash import ROOT_HASH, hash_block
from engine.core.block_manager import BlockManager
from engine.config import EngineConfig
from engine.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    stored_events,
)
from engine.frontend.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence

FP = b"fingerprint"
BS = 4
RECV_MS = 5000  # the longest wait for one message: a lost event fails, it does not hang


# -- helpers ---------------------------------------------------------------------------------
def new_bm(num_blocks: int = 9, **kw) -> BlockManager:
    return BlockManager(num_blocks, BS, enable_caching=True, record_events=True, **kw)


def chain(tokens, block_size: int = BS, extra: bytes = FP) -> list[bytes]:
    hashes, parent = [], ROOT_HASH
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


def stored(hashes, parent, tokens) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                       block_size=BS, lora_id=None, medium="GPU", lora_name=None)


def removed(*hashes) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


def compute(bm: BlockManager, seq_id, tokens) -> list[int]:
    """Admit a sequence with its cache hits, compute all its tokens, register its blocks."""
    hashes = chain(tokens)
    table = bm.allocate(seq_id, len(tokens), bm.find_cached_prefix(hashes, len(tokens)))
    bm.cache_full_blocks(seq_id, hashes, len(tokens), token_slice=lambda s, e: tokens[s:e])
    bm.check_invariants()
    return table


P = list(range(100, 109))  # two full blocks and one token
Q = list(range(200, 213))  # three full blocks and one token


# -- the block manager's log ---------------------------------------------------------------------
def test_blocks_cached_in_two_calls_give_two_events_chained_by_parent():
    bm = new_bm()
    tokens = list(range(100, 114))  # 3 full blocks + 2 tokens
    hashes = chain(tokens)
    assert bm.allocate("a", len(tokens)) == [1, 2, 3, 4]
    take = lambda s, e: tokens[s:e]  # noqa: E731
    bm.cache_full_blocks("a", hashes, 8, token_slice=take)
    bm.cache_full_blocks("a", hashes, 8, token_slice=take)  # nothing new: no event
    bm.cache_full_blocks("a", hashes, 14, token_slice=take)
    assert bm.take_events() == [
        stored(hashes[:2], None, tokens[:8]),
        stored(hashes[2:3], hashes[1], tokens[8:12]),
    ]
    assert bm.take_events() == []
    bm.check_invariants()


def test_cache_hits_are_not_stored_again():
    bm = new_bm()
    compute(bm, "a", P)
    bm.take_events()
    tokens = P[:8] + [7, 7, 7, 7, 7]  # a hit on both of a's blocks, then one new block
    assert compute(bm, "b", tokens) == [1, 2, 4, 5]
    assert bm.take_events() == [stored(chain(tokens)[2:], chain(P)[1], [7, 7, 7, 7])]


def test_a_copy_is_not_stored_until_it_takes_the_hash_over():
    """Two sequences compute the same prompt at once: only the first copy is
    announced; the second is, once the first was evicted and it took over."""
    bm = new_bm()
    hashes = chain(P)
    take = lambda s, e: P[s:e]  # noqa: E731
    assert bm.allocate("a", 9) == [1, 2, 3]
    assert bm.allocate("b", 9) == [4, 5, 6]
    bm.cache_full_blocks("a", hashes, 9, token_slice=take)
    bm.cache_full_blocks("b", hashes, 9, token_slice=take)
    assert bm.take_events() == [stored(hashes, None, P[:8])]
    bm.free("a")  # free: 7 8 3 empty, then 2 and 1 cached (tail first)
    assert compute(bm, "c", Q) == [7, 8, 3, 2]  # evicts block 2: a's second block
    assert bm.take_events()[0] == removed(hashes[1])
    bm.cache_full_blocks("b", hashes, 9, token_slice=take)  # b's block 5 takes hashes[1] over
    assert bm.take_events() == [stored(hashes[1:], hashes[0], P[4:8])]
    assert bm.cached[hashes[1]] == 5
    bm.check_invariants()


def test_evictions_in_a_row_are_one_block_removed_in_eviction_order():
    bm = new_bm(num_blocks=5)
    compute(bm, "a", P)
    bm.free("a")  # free: 3 empty, then 2 and 1 cached: the tail is evicted first
    bm.take_events()
    assert compute(bm, "c", Q) == [4, 3, 2, 1]
    hp, hq = chain(P), chain(Q)
    assert bm.take_events() == [removed(hp[1], hp[0]), stored(hq, None, Q[:12])]
    assert bm.stats.evictions == 2


def test_evicting_a_popular_block_is_a_removal_too():
    bm = new_bm(num_blocks=5)
    compute(bm, "a", P)
    bm.free("a")
    assert bm.set_popular(chain(P)[:1]) == 1  # block 1: evicted last
    bm.take_events()
    assert compute(bm, "c", Q) == [4, 3, 2, 1]
    assert bm.take_events()[0] == removed(chain(P)[1], chain(P)[0])
    assert bm.num_popular_cached == 0
    bm.check_invariants()


def test_reset_is_all_blocks_cleared_and_nothing_else():
    bm = new_bm()
    bm.reset_prefix_cache()  # nothing cached: still announced, as vLLM does
    assert bm.take_events() == [AllBlocksCleared()]
    compute(bm, "a", P)
    bm.free("a")
    bm.take_events()
    assert bm.reset_prefix_cache() == 2
    assert bm.take_events() == [AllBlocksCleared()]
    bm.check_invariants()


def test_events_off_log_nothing():
    bm = BlockManager(5, BS, enable_caching=True)
    assert bm.events is None
    compute(bm, "a", P)
    bm.free("a")
    compute(bm, "c", Q)  # evicts
    bm.reset_prefix_cache()
    assert bm.events is None
    assert bm.take_events() == []


def test_stored_events_group_runs_and_name_each_parent():
    hashes = [bytes([i]) * 32 for i in range(8)]
    tokens = list(range(32))
    events = stored_events([0, 1, 3, 4, 6], hashes, BS, lambda s, e: tokens[s:e])
    assert events == [stored(hashes[0:2], None, tokens[0:8]),
                      stored(hashes[3:5], hashes[2], tokens[12:20]),
                      stored(hashes[6:7], hashes[5], tokens[24:28])]
    assert stored_events([], hashes, BS, None) == []
    assert stored_events([2], hashes, BS, None)[0].token_ids == []


# -- the events replayed into an index equal the cache (scheduler fuzz) ---------------------------
def replay(index: set, events: list) -> None:
    """What a router's index does with the events; checks each stored run's chain."""
    for event in events:
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            for k, block_hash in enumerate(event.block_hashes):
                tokens = event.token_ids[k * BS:(k + 1) * BS]
                assert hash_block(parent or ROOT_HASH, tokens, FP) == block_hash
                parent = block_hash
                index.add(block_hash)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= index, "removed a hash never stored"
            index.difference_update(event.block_hashes)
        else:
            index.clear()


def fake_step(sched: Scheduler, rng: random.Random) -> None:
    out = sched.schedule()
    sched.update(out, {s.seq_id: rng.randrange(1000) for s in out.sequences
                       if s.sampling is not None})
    for seq in list(sched.running):
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            sched.finish(seq, "length")


@pytest.mark.parametrize("seed", range(6))
def test_replayed_events_track_the_cache_exactly(seed):
    rng = random.Random(seed)
    # no admission headroom: the cache fills up and preempts
    config = EngineConfig(block_size=BS, max_num_seqs=4, max_num_batched_tokens=16,
                          schedule_conservativeness=0)
    bm = BlockManager(12, BS, enable_caching=True, record_events=True)
    sched = Scheduler(config, bm)
    heads = [[rng.randrange(1000) for _ in range(8)] for _ in range(3)]
    index: set = set()
    for seq_id in range(40):
        prompt = rng.choice(heads) + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 8))
        sched.add(Sequence(seq_id, f"r{seq_id}", 0, prompt, params, hash_extra=FP))
        if rng.random() < 0.2 and bm.cached:
            bm.set_popular(rng.sample(sorted(bm.cached), 2 if len(bm.cached) > 1 else 1))
        for _ in range(rng.randrange(3)):
            fake_step(sched, rng)
            replay(index, bm.take_events())
            assert index == set(bm.cached)
    while sched.has_unfinished():
        fake_step(sched, rng)
    replay(index, bm.take_events())
    assert index == set(bm.cached) and sched.num_preemptions > 0
    bm.reset_prefix_cache()  # nothing held now: the cache and the index are both empty
    replay(index, bm.take_events())
    assert index == set(bm.cached) == set()
    bm.check_invariants()


# -- the publisher ----------------------------------------------------------------------------------
def subscriber(endpoint: str) -> zmq.Socket:
    """A SUB socket connected to the publisher's bound endpoint, as a router's is."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVTIMEO, RECV_MS)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def handshake(sub: zmq.Socket, probe) -> None:
    """PUB drops what it sends before the subscription arrives (the slow joiner):
    probe until a message gets through, then drop everything received so far."""
    deadline = time.monotonic() + 10
    while not sub.poll(100):
        assert time.monotonic() < deadline, "the subscriber never received anything"
        probe()
    while sub.poll(300):
        sub.recv_multipart()


def receive(sub: zmq.Socket) -> tuple[bytes, int, object]:
    """(topic, sequence number, payload decoded to plain lists and dicts)."""
    topic, seq, payload = sub.recv_multipart()
    assert len(seq) == 8
    return topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)


def test_publisher_frames_sequence_numbers_drops_and_close(monkeypatch):
    publisher = KVEventPublisher("inproc://kv-events-test", topic="kv@pod@model")
    sub = subscriber("inproc://kv-events-test")
    try:
        publisher.publish([])  # nothing to say: nothing sent, no number used
        handshake(sub, lambda: publisher.publish([AllBlocksCleared()]))
        publisher.publish([removed(b"h" * 32)])
        topic, first, batch = receive(sub)
        assert topic == b"kv@pod@model"
        assert batch[1:] == [[{"type": "BlockRemoved", "block_hashes": [b"h" * 32],
                               "medium": "GPU"}], 0]
        assert abs(batch[0] - time.time()) < 60
        monkeypatch.setattr(publisher._queue, "put_nowait", _full)
        publisher.publish([AllBlocksCleared()])  # lost, but its number is used
        monkeypatch.undo()
        assert publisher.dropped == 1
        publisher.publish([AllBlocksCleared()])
        _, seq, batch = receive(sub)
        assert seq == first + 2 and batch[1] == [{"type": "AllBlocksCleared"}]
    finally:
        publisher.close()
        sub.close()
    publisher.close()  # twice is fine
    assert not publisher._thread.is_alive()
    publisher.publish([AllBlocksCleared()])  # after close: ignored


def _full(item):
    raise queue.Full


def test_a_bad_endpoint_fails_at_start_up():
    with pytest.raises(ValueError, match="kv_events_endpoint='tcp://\\*:port'"):
        KVEventPublisher("tcp://*:port")


@pytest.mark.parametrize("endpoint", ["localhost:5557", "http://x:1", "", 5557])
def test_config_refuses_an_endpoint_zmq_cannot_publish_on(endpoint):
    with pytest.raises(ValueError, match="kv_events_endpoint=.* must start with tcp://"):
        EngineConfig(kv_events_endpoint=endpoint)


# -- the tiny model end to end ------------------------------------------------------------------
def generate(engine: LLMEngine, request_id: str, prompt: list[int]) -> Sequence:
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=4,
                                                          ignore_eos=True))
    seq = engine.requests[request_id].seqs[0]
    while engine.has_unfinished_requests():
        engine.step()
    return seq


def stored_dict(hashes, parent, tokens, block_size) -> dict:
    """A BlockStored as any msgpack decoder sees it: a map, "type" first, defaults left out."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": "GPU",
            "lora_name": None}


def test_engine_publishes_what_it_caches_evicts_and_clears(tiny_llama_path, single_thread):
    # The engine binds a loopback port the OS picks; the subscriber connects, as a router does.
    engine = LLMEngine(EngineConfig(
        model=str(tiny_llama_path), dtype="float32", block_size=8, max_model_len=32,
        num_gpu_blocks_override=5, kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_topic="kv@pod@tiny",
    ))
    sub = subscriber(engine.kv_events.bound)
    try:
        handshake(sub, engine.reset_prefix_cache)
        rng = random.Random(3)
        first, second = ([rng.randrange(3, 49152) for _ in range(27)] for _ in range(2))
        started = time.time()
        seq = generate(engine, "a", first)  # 3 full blocks and 3 tokens; 4 blocks in all
        topic, number, batch = receive(sub)
        hashes = chain(first, 8, engine.fingerprint)
        assert topic == b"kv@pod@tiny"
        assert len(batch) == 3 and started <= batch[0] <= time.time() and batch[2] == 0
        assert batch[1] == [stored_dict(hashes, None, first[:24], 8)]
        assert hashes == seq.block_hashes[:3]
        # The second prompt needs all 4 blocks: the first's 3 cached ones are
        # evicted (tail first) in the same step that caches the second's.
        generate(engine, "b", second)
        _, after, batch = receive(sub)
        assert batch[1] == [
            {"type": "BlockRemoved", "block_hashes": hashes[::-1], "medium": "GPU"},
            stored_dict(chain(second, 8, engine.fingerprint), None, second[:24], 8),
        ]
        engine.reset_prefix_cache()
        _, last, batch = receive(sub)
        assert batch[1] == [{"type": "AllBlocksCleared"}]
        assert (after, last) == (number + 1, number + 2)
        assert not sub.poll(200), "a batch without events was sent"
    finally:
        engine.close()
        sub.close()
    assert not engine.kv_events._thread.is_alive()
