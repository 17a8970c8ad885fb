"""Stopping: EOS, stop token ids, stop strings, max_tokens, max_model_len and
min_tokens, decided in one place (engine/sampling/stopping.py) -- exact cases on a toy
tokenizer, stop strings on the real one, a brute-force check of stop-string
matching and streaming hold-back, and min_tokens through the sampler's batch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling.detokenizer import IncrementalDetokenizer
from engine.model.sampling_batch import build_sampling_batch
from engine.sampling.sampler import Sampler, apply_banned_tokens
from engine.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledSequence
from engine.sampling.stopping import Stop, StopChecker, banned_token_ids, may_stop
from test_detokenizer import PieceTokenizer
from test_sampler import eos_favoured_logits

# 0 "a", 1 "b", 2 "c", 3 "#", 4 "##", 5 "x y", 6 "<s>" (special), 7 " "
LETTERS = PieceTokenizer(["a", "b", "c", "#", "##", "x y", "<s>", " "], special=[6])
TOY_EOS = 6
STOP, LENGTH = Stop("stop"), Stop("length")


def make_checker(prompt=(), eos=(TOY_EOS,), max_model_len=1000, tokenizer=LETTERS, **kw):
    kw.setdefault("max_tokens", 100)
    params = SamplingParams(**kw)
    detokenizer = IncrementalDetokenizer(tokenizer, list(prompt), params.skip_special_tokens)
    checker = StopChecker(params, frozenset(eos), max_model_len, len(prompt), detokenizer)
    return checker, detokenizer


def feed(checker, tokens, already=0):
    """Check tokens one at a time, as the engine does; the decision after each."""
    return [checker.check(token, n) for n, token in enumerate(tokens, start=already + 1)]


def stream(checker, detokenizer, tokens, chunk_sizes=()):
    """Feed tokens like the engine, taking a delta after every chunk of them
    (finished once stopped); return (deltas, stop or None)."""
    deltas, stop, position = [], None, 0
    chunk_sizes = iter(chunk_sizes)
    while position < len(tokens) and stop is None:
        for token in tokens[position : position + next(chunk_sizes, 1)]:
            position += 1
            stop = checker.check(token, position)
            if stop is not None:
                break
        deltas.append(detokenizer.get_delta(stop is not None, checker.held_back_length()))
    if stop is None:
        deltas.append(detokenizer.get_delta(True))
    return deltas, stop


# -- EOS and stop token ids ----------------------------------------------------------------


def test_eos_stops_without_its_text():
    for kw in ({}, {"skip_special_tokens": False}, {"include_stop_str_in_output": True}):
        checker, detokenizer = make_checker(**kw)
        assert feed(checker, [0, TOY_EOS]) == [None, STOP]
        assert detokenizer.output_text == "a"


def test_ignore_eos_makes_eos_an_ordinary_token():
    checker, detokenizer = make_checker(ignore_eos=True, skip_special_tokens=False)
    assert feed(checker, [0, TOY_EOS, 1]) == [None, None, None]
    assert detokenizer.output_text == "a<s>b"


def test_every_eos_id_stops():
    for eos in (1, 2):
        checker, _ = make_checker(eos=(1, 2))
        assert feed(checker, [0, eos]) == [None, STOP]


def test_stop_token_id_and_include_stop_str_in_output():
    for include, text in [(False, "a"), (True, "ab")]:
        checker, detokenizer = make_checker(stop_token_ids=[1], include_stop_str_in_output=include)
        assert feed(checker, [0, 1]) == [None, Stop("stop", 1)]
        assert detokenizer.output_text == text


def test_tokens_after_a_stop_are_ignored():
    checker, detokenizer = make_checker(stop_token_ids=[1])
    assert feed(checker, [0, 1, 2, 1]) == [None, Stop("stop", 1), None, None]
    assert checker.stop == Stop("stop", 1)
    assert detokenizer.output_text == "a"


# -- length ----------------------------------------------------------------------------------


def test_max_tokens():
    checker, detokenizer = make_checker(max_tokens=3)
    assert feed(checker, [0, 0, 0]) == [None, None, LENGTH]
    assert detokenizer.output_text == "aaa"


def test_max_model_len_counts_the_prompt():
    checker, detokenizer = make_checker(prompt=[1, 1, 1, 1], max_model_len=6)
    assert feed(checker, [0, 2]) == [None, LENGTH]
    assert detokenizer.output_text == "ac"


# -- min_tokens holds back every kind of stop, but not length ---------------------------------


def test_min_tokens_suppresses_stop_token_ids_and_eos():
    checker, detokenizer = make_checker(stop_token_ids=[1], min_tokens=3, skip_special_tokens=False)
    # Under min_tokens a stop id or EOS is an ordinary token, text included.
    assert feed(checker, [1, TOY_EOS, 1]) == [None, None, Stop("stop", 1)]
    assert detokenizer.output_text == "b<s>"
    checker, detokenizer = make_checker(min_tokens=2)
    assert feed(checker, [TOY_EOS, TOY_EOS]) == [None, STOP]


def test_min_tokens_suppresses_stop_strings():
    checker, detokenizer = make_checker(stop=["a"], min_tokens=3)
    assert feed(checker, [0, 0]) == [None, None]  # "a" twice, but only 2 tokens
    assert feed(checker, [1], already=2) == [None]  # third token: "b", no new match
    assert feed(checker, [0], already=3) == [Stop("stop", "a")]
    assert detokenizer.output_text == "aab"


def test_stop_string_may_complete_with_token_min_tokens():
    checker, _ = make_checker(stop=["ab"], min_tokens=2)
    assert feed(checker, [0, 1]) == [None, Stop("stop", "ab")]


def test_min_tokens_does_not_hold_back_length():
    checker, _ = make_checker(prompt=[1] * 4, max_model_len=6, min_tokens=5, stop_token_ids=[0])
    assert feed(checker, [0, 0]) == [None, LENGTH]
    checker, _ = make_checker(max_tokens=2, min_tokens=2)
    assert feed(checker, [TOY_EOS, TOY_EOS]) == [None, STOP]


# -- precedence within one token ---------------------------------------------------------------


def test_stop_id_beats_eos():
    checker, _ = make_checker(stop_token_ids=[TOY_EOS])
    assert feed(checker, [TOY_EOS]) == [Stop("stop", TOY_EOS)]


def test_any_stop_beats_length():
    for kw, token, stop in [
        ({"stop": ["ab"]}, 1, Stop("stop", "ab")),
        ({"stop_token_ids": [1]}, 1, Stop("stop", 1)),
        ({}, TOY_EOS, STOP),
    ]:
        checker, _ = make_checker(max_tokens=2, **kw)
        assert feed(checker, [0, token]) == [None, stop], kw
        checker, _ = make_checker(prompt=[2], max_model_len=3, **kw)
        assert feed(checker, [0, token]) == [None, stop], kw


def test_stop_token_text_is_still_cut_at_a_stop_string():
    # The stop id wins the stop_reason; its text, kept for
    # include_stop_str_in_output, is cut after the stop string it contains.
    checker, detokenizer = make_checker(
        stop=["x"], stop_token_ids=[5], include_stop_str_in_output=True
    )
    assert feed(checker, [0, 5]) == [None, Stop("stop", 5)]
    assert detokenizer.output_text == "ax"


# -- stop strings (toy tokenizer, exact) -------------------------------------------------------


def test_stop_string_over_several_tokens():
    checker, detokenizer = make_checker(stop=["b##c"])
    tokens = [0, 1, 3, 3, 2, 0]  # a b # # c a
    assert feed(checker, tokens) == [None, None, None, None, Stop("stop", "b##c"), None]
    assert detokenizer.output_text == "a"


def test_include_stop_str_in_output_for_stop_strings():
    checker, detokenizer = make_checker(stop=["b#"], include_stop_str_in_output=True)
    # a b ## c: matches inside "##"; "c" is never consumed
    assert feed(checker, [0, 1, 4, 2]) == [None, None, Stop("stop", "b#"), None]
    assert detokenizer.output_text == "ab#"
    assert detokenizer.get_delta(False, checker.held_back_length()) == "ab#"


def test_earliest_stop_string_wins():
    # One token completes both: "bc" starts first although listed second.
    checker, detokenizer = make_checker(tokenizer=PieceTokenizer(["a", "bcab"]), stop=["cab", "bc"])
    assert feed(checker, [0, 1]) == [None, Stop("stop", "bc")]
    assert detokenizer.output_text == "a"


def test_stop_string_in_prompt_does_not_match():
    checker, detokenizer = make_checker(prompt=LETTERS.encode("ab#"), stop=["#b", "b#"])
    assert feed(checker, [1]) == [None]  # prompt "...#" + "b" must not match "#b"
    assert detokenizer.output_text == "b"


def test_skipped_special_token_between_stop_parts():
    checker, detokenizer = make_checker(stop=["ab"], eos=())
    assert feed(checker, [0, 6, 1]) == [None, None, Stop("stop", "ab")]  # <s> is skipped
    assert detokenizer.output_text == ""
    checker, detokenizer = make_checker(stop=["ab"], skip_special_tokens=False, eos=())
    assert feed(checker, [0, 6, 1]) == [None, None, None]
    assert detokenizer.output_text == "a<s>b"


def test_hold_back_only_possible_stop_prefixes():
    checker, detokenizer = make_checker(stop=["###", "cab"])

    def step(tokens, already):
        feed(checker, tokens, already)
        return detokenizer.get_delta(False, checker.held_back_length())

    assert step([0, 3], 0) == "a"  # "a#": "#" may start "###"
    assert step([3], 2) == ""  # "a##"
    assert step([0], 3) == "##a"  # "a##a": no longer a stop prefix
    assert step([2, 0], 4) == ""  # "ca" may start "cab"
    assert step([2], 6) == "ca"  # "cac": only the last "c" may start "cab"
    assert detokenizer.get_delta(True, checker.held_back_length()) == "c"
    assert detokenizer.output_text == "a##acac"


def test_no_stop_strings_means_no_hold_back():
    checker, detokenizer = make_checker()
    feed(checker, [3, 3])
    assert checker.held_back_length() == 0
    assert detokenizer.get_delta(False, checker.held_back_length()) == "##"


def test_without_tokenizer_stop_strings_never_match():
    checker, detokenizer = make_checker(tokenizer=None, prompt=[1, 2], stop=["a"], eos=())
    assert feed(checker, [5, 6, 7]) == [None, None, None]
    assert checker.stop is None and checker.held_back_length() == 0
    assert detokenizer.output_text == ""


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
    expected_text, expected_stop = reference_stop(
        [PIECES[t] for t in tokens], stops, min_tokens, include
    )
    checker, detokenizer = make_checker(
        tokenizer=TOY, eos=(), stop=stops, min_tokens=min_tokens,
        include_stop_str_in_output=include, max_tokens=30,
    )
    deltas, stop = stream(checker, detokenizer, tokens, chunks)
    # Nothing streamed is ever taken back: no stop string leaks.
    for count in range(1, len(deltas) + 1):
        assert expected_text.startswith("".join(deltas[:count]))
    assert stop == (None if expected_stop is None else Stop("stop", expected_stop))
    assert detokenizer.output_text == expected_text
    assert "".join(deltas) == expected_text



@pytest.mark.parametrize("stops", [["ab", "a"], ["a", "ab"]])
def test_of_two_stops_at_one_place_the_shorter_wins(stops):
    # One token "ab" completes both; "a" was complete first, whatever the order.
    checker, detokenizer = make_checker(tokenizer=TOY, eos=(), stop=stops,
                                        include_stop_str_in_output=True)
    assert feed(checker, [3]) == [Stop("stop", "a")]
    assert detokenizer.output_text == "a"

# -- stop strings on the real tokenizer --------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


def test_stop_string_split_across_tokens_real_tokenizer(tokenizer):
    text = "The answer is 42. Next question: why?"
    ids = tokenizer.encode(text)
    stop = "42. Next"
    # The stop string must really span several tokens for this test to mean anything.
    assert all(stop not in tokenizer.decode([i]) for i in ids)
    for include, expected in [(False, "The answer is "), (True, "The answer is 42. Next")]:
        checker, detokenizer = make_checker(
            tokenizer=tokenizer, eos=(), stop=[stop], include_stop_str_in_output=include
        )
        deltas, matched = stream(checker, detokenizer, ids)
        assert matched == Stop("stop", stop)
        assert detokenizer.output_text == "".join(deltas) == expected


def test_multibyte_stop_string(tokenizer):
    ids = tokenizer.encode("héllo 🤖 世界 🇫🇷 end")
    checker, detokenizer = make_checker(tokenizer=tokenizer, eos=(), stop=["🤖 世"])
    deltas, matched = stream(checker, detokenizer, ids)
    assert matched == Stop("stop", "🤖 世")
    assert detokenizer.output_text == "".join(deltas) == "héllo "


# -- min_tokens before sampling: the banned ids, applied by the sampler ------------------------

EOS = 2


def test_banned_token_ids_exact():
    params = SamplingParams(min_tokens=3, stop_token_ids=[5, 6])
    for produced in range(3):
        assert banned_token_ids(params, produced, [EOS, 3]) == {EOS, 3, 5, 6}
    assert banned_token_ids(params, 3, [EOS, 3]) == set()
    ignoring = SamplingParams(min_tokens=3, stop_token_ids=[5], ignore_eos=True)
    assert banned_token_ids(ignoring, 0, [EOS]) == {5}
    assert banned_token_ids(SamplingParams(), 0, [EOS]) == set()


@pytest.mark.parametrize("min_tokens", [0, 1, 4])
def test_ban_and_stop_check_share_one_min_tokens_rule(min_tokens):
    params = SamplingParams(min_tokens=min_tokens, stop_token_ids=[5])
    for produced in range(6):
        # The next token may not be a stop token exactly while the sequence may not stop.
        assert bool(banned_token_ids(params, produced, [EOS])) == (not may_stop(params, produced))


def requests_for(params, produced=0, rows=1, eos=(EOS,)):
    """The sampler's rows as the runner builds them from the scheduler's output."""
    scheduled = [
        ScheduledSequence(
            seq_id=i, token_ids=[7], start_position=4 + produced, block_table=[1, 2],
            sampling=params, generator=None, prompt_token_ids=[7] * 4,
            output_token_ids=[7] * produced,
        )
        for i in range(rows)
    ]
    return build_sampling_batch(scheduled, frozenset(eos)).requests


def test_min_tokens_blocks_eos_until_reached():
    sampler = Sampler(8)
    params = SamplingParams(temperature=0, min_tokens=3)
    for produced, expected in [(0, 5), (2, 5), (3, EOS), (4, EOS)]:
        out = sampler(eos_favoured_logits(), requests_for(params, produced))
        assert out.token_ids == [expected], produced


def test_min_tokens_blocks_stop_token_ids_and_all_eos_ids():
    params = SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[5])
    requests = requests_for(params, eos=(EOS, 3))
    assert Sampler(8)(eos_favoured_logits(), requests).token_ids == [6]
    masked = apply_banned_tokens(eos_favoured_logits(), requests)
    assert sorted(masked[0].isinf().nonzero().flatten().tolist()) == [EOS, 3, 5]


def test_min_tokens_with_ignore_eos_leaves_eos_alone():
    params = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[5])
    requests = requests_for(params)
    masked = apply_banned_tokens(eos_favoured_logits(), requests)
    assert masked[0].isinf().nonzero().flatten().tolist() == [5]
    assert Sampler(8)(eos_favoured_logits(), requests).token_ids == [EOS]


def test_min_tokens_ignores_out_of_vocab_ids_and_short_circuit():
    logits = eos_favoured_logits()
    params = SamplingParams(min_tokens=1, stop_token_ids=[100])
    masked = apply_banned_tokens(logits, requests_for(params, eos=(200,)))
    assert torch.equal(masked, logits)
    done = SamplingParams(min_tokens=1)
    assert apply_banned_tokens(logits, requests_for(done, produced=1)) is logits


def test_min_tokens_applies_to_sampled_rows():
    params = SamplingParams(min_tokens=5)
    out = Sampler(8, seed=0)(eos_favoured_logits(500), requests_for(params, rows=500))
    assert EOS not in out.token_ids
