"""KV cache events: which prefix blocks a replica holds, published over ZMQ.

A KV-cache-aware router (vllm-router's kv_aware policy, llm-d's scheduler)
keeps an index of the blocks every replica has cached and sends a request
where its prompt's head is already computed. It learns them from events in vLLM's schema
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
queue was full still takes its number, so a subscriber sees the gap. The
endpoint is always bound, as vLLM binds it; subscribers connect.

Replay (vLLM's replay_endpoint): a ROUTER socket bound on its own endpoint
keeps the last `buffer_steps` batches sent. A client (vllm-router uses a
DEALER, at start-up and whenever it sees a gap) sends the first sequence
number it wants, 8 bytes big-endian, and gets every buffered batch from that
number on, then an end marker, each behind the envelope it sent:

    request   [identity, b"", start_seq]            (the ROUTER side)
    batch     [identity, b"", topic, seq, payload]  for each buffered seq >= start_seq
    end       [identity, b"", b"", -1 (8 bytes, signed), b""]

as vLLM's current publisher sends them (older vLLM sent no topic frame; a
reader that takes the last two frames as seq and payload reads both).

A salted (per-tenant) sequence's BlockStored names its tenant in
`lora_name` and in the first block's `extra_keys`: see tenant_tag.

msgspec is a core dependency; zmq is imported only when a publisher starts,
so the block manager, which builds these events, imports without it.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import deque
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
BUFFER_STEPS = 10_000  # batches kept for replay: vLLM's default buffer_steps
SEND_HWM = 100_000  # messages the PUB socket queues per subscriber: vLLM's default hwm
REPLAY_POLL = 0.05  # seconds between looks at the replay socket while no batch comes
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the sequence number ending a replay
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
    # vLLM's schema; set only for a salted chain's first block (tenant_tag).
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
    cache_salt: bytes = b"",
) -> list[BlockStored]:
    """One BlockStored per run of consecutive blocks among the ascending
    `indices` of a sequence's newly cached blocks; `block_hashes` is the
    sequence's hash chain, `token_slice(start, end)` its tokens (None: the
    events carry no tokens) and `cache_salt` its tenant's salt.

    Each event's parent is the hash just before its first block, None for
    the sequence's first block, as vLLM sends it. A salted sequence's events
    name its tenant (`tenant_tag`).
    """
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    tenant = tenant_tag(cache_salt)
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
            lora_name=tenant,
            # vLLM's place for the salt: the extra keys of a chain's first block.
            extra_keys=[(tenant,)] + [None] * (end - 1) if tenant and not start else None,
        ))
    return events


def tenant_tag(salt: bytes) -> str | None:
    """The name a tenant's blocks carry in their events (None: no salt).

    A tenant's cache salt (service/guards/tenancy.py: per API key) goes into the hash of
    its chains' first block, so its blocks never serve another tenant. A
    router must not credit them to another tenant's request either. vLLM puts
    a request's cache_salt in the `extra_keys` of the chain's first block,
    and so do we, but vllm-router's kv_aware policy ignores `extra_keys`: it
    indexes each block by SHA-256 of its `token_ids` seeded with the event's
    `lora_name`, chained by the parent hashes, and looks a request up by the
    token ids its worker renders, with no adapter (checked against
    vllm-router 0.1.17). So the tenant's tag is the `lora_name` of every
    event of its sequences: the same tokens under another salt, or under
    none, hash to other index entries and never match. The router cannot
    learn a request's tenant (the salt is derived from the API key on the
    server), so it routes salted requests by load, never to another tenant's
    blocks. The tag is one-way: it names the tenant without giving away the
    salt that goes into its hashes.
    """
    if not salt:
        return None
    return "salt:" + hashlib.sha256(b"pagedserve kv events tenant\0" + salt).hexdigest()[:16]



def add_removed(events: list, block_hash: bytes) -> None:
    """Log an evicted hash, merged into the BlockRemoved just before it if
    there is one: back-to-back evictions (a step's allocations) travel as one
    event, with the same meaning as one event each."""
    last = events[-1] if events else None
    if isinstance(last, BlockRemoved):
        last.block_hashes.append(block_hash)
    else:
        events.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU))


class KVEventPublisher:
    """Sends event batches from a background thread over a ZMQ PUB socket.

    `publish()` only queues: the engine's step never waits on the network. The
    endpoint is always bound, as vLLM's publisher binds it: subscribers (a
    router, llm-d's indexer) connect to the replica. `tcp://127.0.0.1:5557`
    listens on loopback only, `tcp://*:5557` on every interface; a port `*`
    lets the OS pick one (`bound` names it). With `replay_endpoint`, a ROUTER
    socket bound there answers replay requests from the last `buffer_steps`
    batches sent (see the module docstring). The sockets are bound here, so a
    bad endpoint fails at start-up, then belong to the thread alone (ZMQ
    sockets are not thread-safe) until `close()` has stopped it.
    """

    def __init__(self, endpoint: str, topic: str = "", queue_size: int = QUEUE_SIZE,
                 replay_endpoint: str | None = None,
                 buffer_steps: int = BUFFER_STEPS) -> None:
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
        # (seq, payload) of the batches sent last, for replay; None without replay.
        self._buffer: deque | None = None
        # The shared context, so an inproc:// subscriber in this process can reach us.
        context = zmq.Context.instance()
        self._socket = _bound(context.socket(zmq.PUB), endpoint, "kv_events_endpoint",
                              SEND_HWM)
        self.bound = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = self.replay_bound = None
        if replay_endpoint is not None:
            try:
                # A replay sends up to the whole buffer at once: beyond its
                # high-water mark a ROUTER drops, so the mark holds it all.
                self._replay = _bound(context.socket(zmq.ROUTER), replay_endpoint,
                                      "kv_events_replay_endpoint", buffer_steps + 1)
            except ValueError:
                self._socket.close(linger=0)
                raise
            self.replay_bound = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._buffer = deque(maxlen=buffer_steps)
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
        the sockets. Safe to call twice."""
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
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        topic = self.topic.encode()
        # With a replay socket, wake up to answer it even while no batch comes.
        wait = REPLAY_POLL if self._replay is not None else None
        while True:
            if self._replay is not None:
                self._serve_replays(topic)
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, batch = item
            try:
                payload = encoder.encode(batch)
                self._socket.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            except Exception:  # noqa: BLE001 - one bad batch must not stop the stream
                logger.exception("could not publish KV event batch %d", seq)
                continue
            if self._buffer is not None:
                self._buffer.append((seq, payload))

    def _serve_replays(self, topic: bytes) -> None:
        """Answer every waiting replay request: the buffered batches numbered
        from the one asked for, then the end marker (module docstring)."""
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            # [identity, b"", start] from a DEALER or REQ; [identity, start]
            # from a DEALER that sends no delimiter. The reply keeps the envelope.
            if len(frames) not in (2, 3) or len(frames[-1]) != 8 or any(frames[1:-1]):
                logger.warning("ignoring a malformed KV event replay request (%d frames)",
                               len(frames))
                continue
            envelope, start = frames[:-1], int.from_bytes(frames[-1], "big")
            try:
                for seq, payload in self._buffer:
                    if seq >= start:
                        self._replay.send_multipart(
                            (*envelope, topic, seq.to_bytes(8, "big"), payload))
                self._replay.send_multipart((*envelope, b"", END_SEQ, b""))
            except Exception:  # noqa: BLE001 - a bad client must not stop the stream
                logger.exception("could not answer a KV event replay request")


def _bound(socket, endpoint: str, name: str, hwm: int):
    """`socket` bound to `endpoint` with send high-water mark `hwm`; a ValueError
    naming the setting when ZMQ refuses it (the socket is closed then)."""
    import zmq

    try:
        socket.setsockopt(zmq.SNDHWM, hwm)
        socket.bind(endpoint)
    except zmq.ZMQError as exc:
        socket.close(linger=0)
        raise ValueError(f"{name}={endpoint!r}: {exc}") from None
    return socket
