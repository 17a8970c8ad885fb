"""KV cache events: which prefix blocks a replica holds, published over ZMQ.

A KV-cache-aware router (llm-d's scheduler) keeps an index of the blocks
every replica has cached and sends a request where its prompt's head is
already computed. It learns them from events in vLLM's schema
(vllm/distributed/kv_events.py), which this module reproduces, so a replica
of ours is indexed like a vLLM one:

    BlockStored       blocks newly cached: their hashes, the hash of the block
                      before the first (None at a sequence's start), their tokens
    BlockRemoved      cached blocks whose content was evicted
    AllBlocksCleared  the prefix cache was reset

The hashes are the engine's own (engine/core/block_hash.py): 32 raw bytes each,
which vLLM's schema allows (its hashes are `bytes | int`).

On the wire, one batch of events is one ZMQ multipart message:

    +--------------+---------------------+----------------------------------+
    | topic        | sequence number     | payload (msgpack)                |
    | utf-8 bytes  | 8 bytes, big-endian | [ts, [event, ...], rank]         |
    +--------------+---------------------+----------------------------------+
      frame 0         frame 1               frame 2

The payload is an array (EventBatch is array-like): the time the batch was
published, its events, and the data-parallel rank, always 0 here as from a
single-rank vLLM. Each event is a map whose "type" key names it:

    {"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": h0,
     "token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU",
     "lora_name": None}

Sequence numbers count batches from 0; a batch dropped because the send
queue was full still takes its number, so a subscriber sees the gap.

msgspec is a core dependency; zmq is imported only when a publisher starts,
so the block manager, which builds these events, imports without it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import msgspec

logger = logging.getLogger(__name__)

# The medium of the engine's primary KV pool. vLLM calls its device pool "GPU"
# and consumers (llm-d) key a replica's primary tier by that name, so the pool
# is "GPU" here whatever the device, a CPU run included.
MEDIUM_GPU = "GPU"
# vLLM's publisher stamps every batch with its data-parallel rank; a replica of
# ours is one rank. Consumers decode the batch as a 3-element array.
DATA_PARALLEL_RANK = 0
QUEUE_SIZE = 10_000  # batches waiting for the publisher thread; beyond, dropped
CLOSE_TIMEOUT = 2.0  # seconds close() waits for queued batches to go out

BlockHash = bytes | int  # vLLM's ExternalBlockHash


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event encodes as a map whose "type" key is its class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # Left at None by this engine; in vLLM's schema, so consumers can rely on it.
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def stored_events(
    indices: list[int],
    block_hashes: list[bytes],
    block_size: int,
    token_slice: Callable[[int, int], list[int]] | None,
) -> list[BlockStored]:
    """One BlockStored per run of consecutive blocks among the ascending
    `indices` of a sequence's newly cached blocks; `block_hashes` is the
    sequence's hash chain and `token_slice(start, end)` its tokens (None: the
    events carry no tokens).

    Each event's parent is the hash just before its first block, None for
    the sequence's first block, as vLLM sends it.
    """
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    events = []
    for run in runs:
        start, end = run[0], run[-1] + 1
        events.append(BlockStored(
            block_hashes=block_hashes[start:end],
            parent_block_hash=block_hashes[start - 1] if start else None,
            token_ids=token_slice(start * block_size, end * block_size) if token_slice else [],
            block_size=block_size,
            lora_id=None,
            medium=MEDIUM_GPU,
            lora_name=None,
        ))
    return events


def add_removed(events: list, block_hash: bytes) -> None:
    """Log an evicted hash, merged into the BlockRemoved just before it if
    there is one: back-to-back evictions (a step's allocations) travel as one
    event, with the same meaning as one event each."""
    last = events[-1] if events else None
    if isinstance(last, BlockRemoved):
        last.block_hashes.append(block_hash)
    else:
        events.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU))


def binds(endpoint: str) -> bool:
    """Whether the publisher binds `endpoint` (else it connects), as vLLM decides.

    A wildcard (`tcp://*:5557`), an IPv6 any-address, ipc:// and inproc://
    are bound: subscribers come to us. Any other address is a subscriber that
    bound it first (llm-d's indexer binds `tcp://*:5557`), so we connect.
    """
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Sends event batches from a background thread over a ZMQ PUB socket.

    `publish()` only queues: the engine's step never waits on the network. The
    socket is bound or connected here, so a bad endpoint fails at start-up,
    then belongs to the thread alone (ZMQ sockets are not thread-safe) until
    `close()` has stopped it.
    """

    def __init__(self, endpoint: str, topic: str = "", queue_size: int = QUEUE_SIZE) -> None:
        try:
            import zmq
        except ImportError as exc:
            raise RuntimeError("KV events (--kv-events-endpoint) need pyzmq: "
                               "pip install pyzmq") from exc
        self.endpoint = endpoint
        self.topic = topic
        self.dropped = 0  # batches lost to a full queue
        self._next_seq = 0
        self._closed = False
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        # The shared context, so an inproc:// subscriber in this process can reach us.
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        try:
            if binds(endpoint):
                self._socket.bind(endpoint)
            else:
                self._socket.connect(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise ValueError(f"kv_events_endpoint={endpoint!r}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list) -> None:
        """Queue one batch of events (none: nothing is sent). Never blocks."""
        if not events or self._closed:
            return
        batch = KVEventBatch(ts=time.time(), events=events,
                             data_parallel_rank=DATA_PARALLEL_RANK)
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        """Send what is queued (for up to CLOSE_TIMEOUT), stop the thread, close
        the socket. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=CLOSE_TIMEOUT)
        except queue.Full:
            pass  # the thread is stuck or gone; it is a daemon
        self._thread.join(CLOSE_TIMEOUT)
        if self._thread.is_alive():
            logger.warning("the KV event publisher did not stop; leaving its socket open")
            return
        self._socket.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        topic = self.topic.encode()
        while True:
            item = self._queue.get()
            if item is None:
                return
            seq, batch = item
            try:
                payload = encoder.encode(batch)
                self._socket.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            except Exception:  # noqa: BLE001 - one bad batch must not stop the stream
                logger.exception("could not publish KV event batch %d", seq)
