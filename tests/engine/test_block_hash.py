"""Content hashes of KV blocks (engine/core/block_hash.py) and the chains that
Sequence.update_block_hashes builds from them: the same in every process,
different whenever anything that decides a block's K/V differs."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_hash import ROOT_HASH, hash_block, prefix_hashes, salt_digest
from engine.sampling_params import SamplingParams
from engine.core.sequence import Sequence

REPO = Path(__file__).resolve().parents[2]
FINGERPRINT = hashlib.sha256(b"model A").digest()
SALT = hashlib.sha256(b"tenant 1").digest()


def make_seq(prompt, output=(), *, extra=FINGERPRINT, salt=b"") -> Sequence:
    seq = Sequence(
        seq_id=0,
        request_id="r",
        index=0,
        prompt_token_ids=list(prompt),
        params=SamplingParams(temperature=0, max_tokens=4),
        hash_extra=extra,
        cache_salt=salt,
    )
    seq.output_token_ids = list(output)
    return seq


def seq_hashes(prompt, block_size, output=(), *, extra=FINGERPRINT, salt=b"") -> list[bytes]:
    seq = make_seq(prompt, output, extra=extra, salt=salt)
    seq.update_block_hashes(block_size)
    return list(seq.block_hashes)


def manual_chain(tokens, block_size, *, extra=FINGERPRINT, salt=b"") -> list[bytes]:
    """The documented chain: salt in block 0 only, parent = previous hash."""
    hashes, parent = [], ROOT_HASH
    for i in range(len(tokens) // block_size):
        parent = hash_block(
            parent, tokens[i * block_size:(i + 1) * block_size], extra + salt if i == 0 else extra
        )
        hashes.append(parent)
    return hashes


TOKENS = [1, 9, 49151, 0, 7, 7, 7, 7, 123456789, 2**40, 5, 6, 3, 3, 3]  # 3 full blocks of 4 + 3


# -- the byte layout and the root ----------------------------------------------------------------
def test_root_hash_is_fixed():
    assert ROOT_HASH == hashlib.sha256(b"pagedserve prefix cache v1").digest()
    assert len(ROOT_HASH) == 32


def test_hash_block_byte_layout():
    """SHA-256 over parent | u32 count | i64 tokens (little endian) | u32 len(extra) | extra."""
    tokens, extra = [3, 1, 2**40, 0], b"xyz"
    expected = hashlib.sha256(
        ROOT_HASH + struct.pack("<I", 4) + struct.pack("<4q", *tokens)
        + struct.pack("<I", 3) + extra
    ).digest()
    assert hash_block(ROOT_HASH, tokens, extra) == expected
    assert hash_block(ROOT_HASH, tuple(tokens), extra) == expected  # any sequence type
    empty = hashlib.sha256(ROOT_HASH + struct.pack("<I", 0) + struct.pack("<I", 0)).digest()
    assert hash_block(ROOT_HASH, []) == empty


# -- determinism across processes ----------------------------------------------------------------
_CHILD = r"""
import json, sys
from engine.core.block_hash import ROOT_HASH, hash_block, prefix_hashes, salt_digest
from engine.sampling_params import SamplingParams
from engine.core.sequence import Sequence
spec = json.loads(sys.argv[1])
out = {"root": ROOT_HASH.hex(), "chains": []}
for case in spec:
    seq = Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=case["prompt"],
                   params=SamplingParams(temperature=0, max_tokens=4),
                   hash_extra=bytes.fromhex(case["extra"]), cache_salt=bytes.fromhex(case["salt"]))
    seq.output_token_ids = case["output"]
    seq.update_block_hashes(case["bs"])
    out["chains"].append([h.hex() for h in seq.block_hashes])
out["single"] = hash_block(ROOT_HASH, [5, 6, 7], b"extra bytes").hex()
print(json.dumps(out))
"""


def test_hashes_identical_in_another_process_with_another_hash_seed():
    cases = [
        dict(prompt=TOKENS, output=[], bs=4, extra=FINGERPRINT.hex(), salt=""),
        dict(prompt=TOKENS, output=[], bs=4, extra=FINGERPRINT.hex(), salt=SALT.hex()),
        dict(prompt=TOKENS[:6], output=TOKENS[6:], bs=2, extra="", salt=b"str salt".hex()),
        dict(prompt=list(range(40)), output=[99], bs=8, extra=b"fp".hex(), salt=""),
    ]
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    env = {**os.environ, "PYTHONHASHSEED": seed}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(cases)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    assert child["root"] == ROOT_HASH.hex()
    assert child["single"] == hash_block(ROOT_HASH, [5, 6, 7], b"extra bytes").hex()
    here = [
        [h.hex() for h in seq_hashes(c["prompt"], c["bs"], c["output"],
                                     extra=bytes.fromhex(c["extra"]), salt=bytes.fromhex(c["salt"]))]
        for c in cases
    ]
    assert [len(c) for c in here] == [3, 3, 7, 5]
    assert child["chains"] == here
    # and the cases really are different chains
    assert len({c[0] for c in here}) == 4


# -- every input changes the hash ----------------------------------------------------------------
def test_any_token_change_changes_the_hash():
    base = [10, 20, 30, 40]
    reference = hash_block(ROOT_HASH, base, b"e")
    seen = {reference}
    for position in range(4):
        for delta in (1, -1, 2**32):
            tokens = list(base)
            tokens[position] += delta
            h = hash_block(ROOT_HASH, tokens, b"e")
            assert h != reference
            seen.add(h)
    assert len(seen) == 1 + 4 * 3  # all distinct
    assert hash_block(ROOT_HASH, [40, 30, 20, 10], b"e") != reference  # order matters
    assert hash_block(ROOT_HASH, base[:3], b"e") != reference  # length matters
    assert hash_block(ROOT_HASH, base + [0], b"e") != reference


def test_parent_extra_and_salt_change_the_hash():
    tokens = [10, 20, 30, 40]
    reference = hash_block(ROOT_HASH, tokens, FINGERPRINT)
    other_parent = hash_block(ROOT_HASH, [1], FINGERPRINT)
    assert hash_block(other_parent, tokens, FINGERPRINT) != reference
    assert hash_block(ROOT_HASH, tokens, hashlib.sha256(b"model B").digest()) != reference
    assert hash_block(ROOT_HASH, tokens, b"") != reference
    assert hash_block(ROOT_HASH, tokens, FINGERPRINT + SALT) != reference
    assert hash_block(ROOT_HASH, tokens, FINGERPRINT + hashlib.sha256(b"t2").digest()) != \
        hash_block(ROOT_HASH, tokens, FINGERPRINT + SALT)
    # tokens and extra are length-delimited: bytes cannot slide from one into the other
    assert hash_block(ROOT_HASH, [1], b"") != hash_block(ROOT_HASH, [], struct.pack("<q", 1))
    # determinism in-process
    assert hash_block(ROOT_HASH, tokens, FINGERPRINT) == reference


# -- chains in Sequence ----------------------------------------------------------------------------
def test_sequence_chain_matches_documented_formula():
    assert seq_hashes(TOKENS, 4) == manual_chain(TOKENS, 4)
    assert seq_hashes(TOKENS, 4, salt=SALT) == manual_chain(TOKENS, 4, salt=SALT)
    assert seq_hashes(TOKENS, 1) == manual_chain(TOKENS, 1)
    assert len(seq_hashes(TOKENS, 1)) == 15
    assert seq_hashes(TOKENS, 16) == []  # no full block: nothing hashed
    assert len(seq_hashes(TOKENS, 5)) == 3 and len(seq_hashes(TOKENS, 15)) == 1


def test_salt_enters_through_the_first_block_only():
    plain = seq_hashes(TOKENS, 4)
    salted = seq_hashes(TOKENS, 4, salt=SALT)
    assert len(plain) == len(salted) == 3
    # every block differs, because block 0 differs and the rest chain from it
    assert all(a != b for a, b in zip(plain, salted))
    assert salted[0] == hash_block(ROOT_HASH, TOKENS[0:4], FINGERPRINT + SALT)
    # later blocks carry only the fingerprint: the salt reaches them through the parent
    assert salted[1] == hash_block(salted[0], TOKENS[4:8], FINGERPRINT)
    assert salted[2] == hash_block(salted[1], TOKENS[8:12], FINGERPRINT)
    # same tokens + same salt -> same chain; another salt -> another chain
    assert seq_hashes(TOKENS, 4, salt=SALT) == salted
    other = seq_hashes(TOKENS, 4, salt=hashlib.sha256(b"tenant 2").digest())
    assert all(a != b for a, b in zip(other, salted))
    assert all(a != b for a, b in zip(other, plain))


def test_fingerprint_changes_every_block():
    a = seq_hashes(TOKENS, 4)
    b = seq_hashes(TOKENS, 4, extra=hashlib.sha256(b"model B").digest())
    assert all(x != y for x, y in zip(a, b))
    assert b[1] == hash_block(b[0], TOKENS[4:8], hashlib.sha256(b"model B").digest())


@pytest.mark.parametrize("position", range(16))
def test_block_hash_depends_on_every_earlier_token(position):
    tokens = list(range(100, 116))  # 4 blocks of 4
    reference = seq_hashes(tokens, 4)
    changed = list(tokens)
    changed[position] = 7
    hashes = seq_hashes(changed, 4)
    block = position // 4
    assert hashes[:block] == reference[:block]  # blocks before the change: unaffected
    for i in range(block, 4):  # the block holding it and every later one: all differ
        assert hashes[i] != reference[i]


def test_incremental_hashing_across_prompt_and_output():
    """Hashing as tokens arrive (prompt, then outputs one by one) gives the same
    chain as hashing everything at once; partial blocks are never hashed."""
    prompt, output = TOKENS[:6], TOKENS[6:]
    seq = make_seq(prompt, salt=SALT)
    seq.update_block_hashes(4)
    assert len(seq.block_hashes) == 1
    for i, token in enumerate(output):
        seq.append_token(token)
        seq.update_block_hashes(4)
        assert len(seq.block_hashes) == (6 + i + 1) // 4
    assert seq.block_hashes == seq_hashes(TOKENS, 4, salt=SALT)
    # the prompt/output split does not matter, only the token stream
    assert seq_hashes(TOKENS[:1], 4, TOKENS[1:], salt=SALT) == seq.block_hashes
    assert seq_hashes(TOKENS[:14], 4, TOKENS[14:], salt=SALT) == seq.block_hashes
    # calling again without new tokens adds nothing and changes nothing
    before = list(seq.block_hashes)
    seq.update_block_hashes(4)
    assert seq.block_hashes == before


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31), min_size=0, max_size=40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    cut=st.integers(0, 40),
    salt=st.sampled_from([b"", SALT]),
)
def test_chain_of_a_prefix_is_a_prefix_of_the_chain(tokens, block_size, cut, salt):
    full = seq_hashes(tokens, block_size, salt=salt)
    assert full == manual_chain(tokens, block_size, salt=salt)
    assert len(full) == len(tokens) // block_size
    part = seq_hashes(tokens[:cut], block_size, salt=salt)
    assert part == full[: len(part)]
    assert len(set(full)) == len(full)  # a chain never repeats a hash


@pytest.mark.parametrize("block_size", [1, 4, 5, 16])
def test_prefix_hashes_equal_the_sequence_chain(block_size):
    """The fleet registry hashes a prefix without a Sequence: the same chain."""
    for salt in (b"", SALT):
        assert prefix_hashes(TOKENS, block_size, FINGERPRINT, salt) == seq_hashes(
            TOKENS, block_size, salt=salt)


def test_salt_digest():
    assert salt_digest(None) == salt_digest("") == b""
    assert salt_digest("tenant") == hashlib.sha256(b"tenant").digest()
