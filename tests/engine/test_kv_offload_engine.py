"""KV offload end to end on the tiny Llama in float32: the tiers change what is
computed, never what is generated.

The workload cycles six distinct 48-token prefixes (6 blocks of 8) three times
through a device pool that holds about two of them, so each prefix has been
evicted by the time it comes round again. Round 1 computes a prefix, round 2
(its second sighting) stores it, round 3 finds it in the tier. Every run is
compared token for token with the same workload and offloading off, with the
same KV cache dtype (float32, or int8 rows: --kv-cache-dtype int8, or fp8).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time

import pytest

from engine import LLM, SamplingParams
from engine.core.block_hash import ROOT_HASH, block_extra, hash_block
from engine.core.kv_offload.disk import DiskTier
from engine.core.kv_offload.host import HostTier
from need import need
from redis_server import RedisServer, redis_binary

VOCAB = 49152
BS = 8
PREFIXES = 6
PREFIX_TOKENS = 48


def workload(rounds: int = 3, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    return [p + [rng.randrange(3, VOCAB) for _ in range(5)] for _ in range(rounds) for p in prefixes]


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def tiny_llm(path, **offload) -> LLM:
    return LLM(str(path), dtype="float32", block_size=BS, max_model_len=128,
               max_num_batched_tokens=64, num_gpu_blocks_override=34, seed=0, **offload)


def run(path, prompts, pair: int = 2, **offload):
    """Generate `pair` prompts at a time; outputs, engine stats and offload stats."""
    llm = tiny_llm(path, **offload)
    try:
        outputs = []
        for i in range(0, len(prompts), pair):
            results = llm.generate(prompts[i:i + pair], greedy(), use_tqdm=False)
            outputs += [r.outputs[0].token_ids for r in results]
        return outputs, llm.engine.stats(), llm.engine.offload_stats(), llm
    finally:
        manager = llm.engine.block_manager
        manager.check_invariants()
        assert manager.num_free_blocks == manager.num_usable_blocks, "blocks leaked"
        llm.engine.close()


@pytest.fixture(scope="module")
def baseline(tiny_llama_path, single_thread):
    outputs, stats, offload, _ = run(tiny_llama_path, workload())
    assert offload is None
    return outputs, stats


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    need(redis_binary() is not None, "redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.kill()


def tier_args(kind: str, tmp_path, redis_url=None) -> dict:
    if kind == "host":
        return {"kv_offload_host_bytes": 64 << 20}
    if kind == "disk":
        return {"kv_offload_disk_dir": str(tmp_path / "kv"), "kv_offload_disk_bytes": 64 << 20}
    return {"kv_offload_redis_url": redis_url}


def empty_tier_args(kind: str, tmp_path, request) -> dict:
    """tier_args of a tier that holds nothing yet (the module's Redis flushed)."""
    redis_url = request.getfixturevalue("redis_url") if kind == "redis" else None
    if redis_url:
        import redis
        redis.Redis.from_url(redis_url).flushall()
    return tier_args(kind, tmp_path, redis_url)


@pytest.mark.parametrize("kind", ["host", "disk", "redis"])
def test_each_tier_gives_identical_outputs_with_hits(kind, baseline, tiny_llama_path, tmp_path,
                                                     request):
    outputs, stats, offload, _ = run(tiny_llama_path, workload(),
                                     **empty_tier_args(kind, tmp_path, request))
    base_outputs, base_stats = baseline
    assert outputs == base_outputs
    tier = offload["tiers"][kind]
    # Round 3 loads all six prefixes: their blocks short of the last token's.
    assert tier["hits"] == PREFIXES * (PREFIX_TOKENS // BS)
    assert tier["stores"] == PREFIXES * (PREFIX_TOKENS // BS)
    assert offload["blocks_load_failed"] == 0
    saved = base_stats["prompt_tokens_computed"] - stats["prompt_tokens_computed"]
    assert saved == PREFIXES * PREFIX_TOKENS
    assert stats["prefix_cache_hits"] - base_stats["prefix_cache_hits"] == saved


# -- an int8 KV cache (--kv-cache-dtype int8): its blocks are bytes like any other ----------
@pytest.fixture(scope="module")
def int8_baseline(tiny_llama_path, single_thread) -> list[list[int]]:
    outputs, _, offload, _ = run(tiny_llama_path, workload(), kv_cache_dtype="int8")
    assert offload is None
    return outputs


@pytest.mark.parametrize("kind", ["host", "disk", "redis"])
def test_each_tier_gives_int8_blocks_back_unchanged(kind, int8_baseline, tiny_llama_path,
                                                    tmp_path, request):
    outputs, _, offload, _ = run(tiny_llama_path, workload(), kv_cache_dtype="int8",
                                 **empty_tier_args(kind, tmp_path, request))
    assert outputs == int8_baseline
    assert offload["tiers"][kind]["hits"] == PREFIXES * (PREFIX_TOKENS // BS)
    assert offload["blocks_load_failed"] == 0


def test_fp8_blocks_come_back_from_the_host_tier(tiny_llama_path, tmp_path, request, single_thread):
    """An fp8 cache's blocks (bytes torch cannot index as fp8) through the host tier."""
    expected, _, _, _ = run(tiny_llama_path, workload(), kv_cache_dtype="fp8")
    outputs, _, offload, _ = run(tiny_llama_path, workload(), kv_cache_dtype="fp8",
                                 **empty_tier_args("host", tmp_path, request))
    assert outputs == expected
    assert offload["tiers"]["host"]["hits"] == PREFIXES * (PREFIX_TOKENS // BS)


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_a_block_of_another_cache_dtype_is_never_read(kind, int8_baseline, tiny_llama_path,
                                                      tmp_path, request):
    """A float32 cache's replica stores rounds 1-2 in a shared tier; an int8 one
    serving round 3 from it finds none of those blocks (the cache dtype is in
    their namespace) and computes what an int8 cache computes."""
    args = empty_tier_args(kind, tmp_path, request)
    prompts = workload()
    run(tiny_llama_path, prompts[:2 * PREFIXES], **args)
    outputs, _, offload, _ = run(tiny_llama_path, prompts[2 * PREFIXES:], kv_cache_dtype="int8",
                                 **args)
    assert outputs == int8_baseline[2 * PREFIXES:]
    tier = offload["tiers"][kind]
    assert tier["hits"] == 0 and tier["bad_records"] == 0  # missed, not read and refused
    assert offload["blocks_loaded"] == 0


def test_disk_tier_outlives_the_engine(baseline, tiny_llama_path, tmp_path):
    """A new engine on the same folder (a restarted replica) loads what the first stored."""
    args = tier_args("disk", tmp_path)
    prompts = workload()
    run(tiny_llama_path, prompts[:2 * PREFIXES], **args)  # rounds 1-2: computed, stored
    outputs, _, offload, _ = run(tiny_llama_path, prompts[2 * PREFIXES:], **args)
    assert outputs == baseline[0][2 * PREFIXES:]
    assert offload["tiers"]["disk"]["hits"] == PREFIXES * (PREFIX_TOKENS // BS)


def test_lower_tier_hits_are_promoted(baseline, tiny_llama_path, tmp_path):
    """Host and disk together: a block found on disk only is copied up into host memory."""
    args = {**tier_args("disk", tmp_path), **tier_args("host", tmp_path)}
    prompts = workload()
    run(tiny_llama_path, prompts[:2 * PREFIXES], **tier_args("disk", tmp_path))
    outputs, _, offload, _ = run(tiny_llama_path, prompts[2 * PREFIXES:], **args)
    assert outputs == baseline[0][2 * PREFIXES:]
    blocks = PREFIXES * (PREFIX_TOKENS // BS)
    assert offload["tiers"]["disk"]["hits"] == blocks
    assert offload["tiers"]["host"]["stores"] == blocks  # the promotions
    assert offload["tiers"]["host"]["hits"] == 0


def test_requests_share_a_load(baseline, tiny_llama_path, tmp_path):
    """Three requests on one stored prefix arrive together: one load job, not three."""
    prompts = workload()
    llm = tiny_llm(tiny_llama_path, **tier_args("host", tmp_path))
    try:
        for i in (0, PREFIXES):  # prefix 0 twice: computed, then stored
            llm.generate([prompts[i]], greedy(), use_tqdm=False)
        for i in range(1, PREFIXES):  # evict prefix 0 from the device
            llm.generate([prompts[i]], greedy(), use_tqdm=False)
        rng = random.Random(9)
        same = [prompts[0][:PREFIX_TOKENS] + [rng.randrange(3, VOCAB) for _ in range(4)]
                for _ in range(3)]
        loads_before = llm.engine.offload_stats()["loads"]
        shared = llm.generate(same, greedy(), use_tqdm=False)
        assert llm.engine.offload_stats()["loads"] == loads_before + 1
    finally:
        llm.engine.close()
    reference = tiny_llm(tiny_llama_path).generate(same, greedy(), use_tqdm=False)
    assert [r.outputs[0].token_ids for r in shared] == \
        [r.outputs[0].token_ids for r in reference]


class SlowHostTier(HostTier):
    """A host tier whose loads wait for the test's go-ahead: a slow medium, on demand."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.go = threading.Event()
        self.go.set()

    def _load(self, block_hash):
        assert self.go.wait(30)
        return super()._load(block_hash)


def test_a_load_holds_up_nobody_and_an_abort_frees_its_blocks(tiny_llama_path, tmp_path):
    """While one request's load is stuck, a request behind it runs to the end;
    aborting the stuck request gives every block back once the load lands."""
    llm = tiny_llm(tiny_llama_path, **tier_args("host", tmp_path))
    engine = llm.engine
    offload = engine.offload
    slow = SlowHostTier(offload.namespace, 64 << 20, offload.tiers[0].record_bytes)
    offload.tiers[0] = slow
    offload.local[0] = slow
    try:
        prompts = workload()
        for i in (0, PREFIXES, 1, 2, 3, 4, 5):  # prefix 0 stored, then evicted
            llm.generate([prompts[i]], greedy(), use_tqdm=False)
        slow.go.clear()
        engine.add_request("stuck", prompts[2 * PREFIXES], greedy())
        engine.add_request("behind", prompts[PREFIXES + 4], greedy())
        finished = set()
        deadline = time.monotonic() + 30
        while "behind" not in finished and time.monotonic() < deadline:
            finished |= {out.request_id for out in engine.step() if out.finished}
        assert "behind" in finished and "stuck" not in finished
        assert engine.scheduler.loading  # still waiting aside
        engine.abort_request("stuck")
        slow.go.set()
        while offload.loading:
            engine.step()
        manager = engine.block_manager
        manager.check_invariants()
        assert manager.num_free_blocks == manager.num_usable_blocks
    finally:
        slow.go.set()
        engine.close()


def test_redis_tier_down_means_misses(baseline, tiny_llama_path, tmp_path, caplog):
    """Redis gone before round 3: every load misses, outputs stay identical."""
    need(redis_binary() is not None, "redis-server is not installed")
    server = RedisServer(tmp_path).start()
    prompts = workload()
    llm = tiny_llm(tiny_llama_path, kv_offload_redis_url=server.url)
    try:
        outputs = []
        for i in range(0, 2 * PREFIXES, 2):
            outputs += [r.outputs[0].token_ids
                        for r in llm.generate(prompts[i:i + 2], greedy(), use_tqdm=False)]
        time.sleep(0.5)  # the store thread's writes are in
        server.kill()
        started = time.monotonic()
        for i in range(2 * PREFIXES, len(prompts), 2):
            outputs += [r.outputs[0].token_ids
                        for r in llm.generate(prompts[i:i + 2], greedy(), use_tqdm=False)]
        assert time.monotonic() - started < 30
        stats = llm.engine.offload_stats()
    finally:
        llm.engine.close()
        server.kill()
    assert outputs == baseline[0]
    assert stats["tiers"]["redis"]["up"] == 0
    assert stats["blocks_loaded"] == 0


def test_corrupt_disk_records_are_recomputed(baseline, tiny_llama_path, tmp_path):
    """Every stored file damaged between runs: misses, bad records counted, same outputs."""
    args = tier_args("disk", tmp_path)
    prompts = workload()
    run(tiny_llama_path, prompts[:2 * PREFIXES], **args)
    files = sorted((tmp_path / "kv").rglob("*.kv"))
    assert len(files) == PREFIXES * (PREFIX_TOKENS // BS)
    for path in files:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    outputs, _, offload, _ = run(tiny_llama_path, prompts[2 * PREFIXES:], **args)
    assert outputs == baseline[0][2 * PREFIXES:]
    disk = offload["tiers"]["disk"]
    assert disk["hits"] == 0 and disk["bad_records"] > 0
    assert offload["blocks_loaded"] == 0


def test_unwritable_disk_tier_is_disabled_once(baseline, tiny_llama_path, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    caplog.set_level(logging.WARNING, logger="engine.core.kv_offload")
    outputs, _, offload, _ = run(tiny_llama_path, workload(),
                                 kv_offload_disk_dir=str(blocker / "kv"))
    assert outputs == baseline[0]
    assert offload["tiers"]["disk"]["up"] == 0
    warnings = [r for r in caplog.records if r.name.startswith("engine.core.kv_offload")
                and r.levelno == logging.WARNING]
    assert len(warnings) == 1


def test_full_disk_tier_is_disabled_once(baseline, tiny_llama_path, tmp_path, caplog):
    """The first block's temporary file is /dev/full: a real ENOSPC from the kernel."""
    prompts = workload()
    llm = tiny_llm(tiny_llama_path, **tier_args("disk", tmp_path))
    tier = llm.engine.offload.tiers[0]
    assert isinstance(tier, DiskTier)
    # The first block stored: prompt 0's first block, hashed as the engine hashes it.
    h0 = hash_block(ROOT_HASH, prompts[0][:BS], block_extra(0, llm.engine.fingerprint, b""))
    folder = next(p for p in (tmp_path / "kv").iterdir() if p.is_dir())
    (folder / f"{h0.hex()}.{os.getpid()}.tmp").symlink_to("/dev/full")
    caplog.set_level(logging.WARNING, logger="engine.core.kv_offload")
    try:
        outputs = []
        for i in range(0, len(prompts), 2):
            outputs += [r.outputs[0].token_ids
                        for r in llm.generate(prompts[i:i + 2], greedy(), use_tqdm=False)]
        stats = llm.engine.offload_stats()
    finally:
        llm.engine.close()
    assert outputs == baseline[0]
    assert stats["tiers"]["disk"]["up"] == 0
    warnings = [r for r in caplog.records if r.name.startswith("engine.core.kv_offload")
                and r.levelno == logging.WARNING]
    assert len(warnings) == 1
