"""Streaming detokenization with SentencePiece-style tokenizers (Llama, Mistral,
Gemma, Phi-3): "▁" spaces, a leading space dropped at the start of a decode,
and "<0xNN>" byte-fallback tokens whose runs decode as a whole.

The toy tokenizers come from tests/sp_tokenizers.py (trained offline). The
rule checked everywhere: feeding output tokens one at a time and joining every
delta gives exactly what tokenizer.decode gives for the output -- the text the
output adds to the prompt's, when there is a prompt -- and the text streamed so
far is always a prefix of it (nothing streamed is ever taken back). Last, the
same through the engine, on a tiny random Llama with the Llama-style tokenizer.
"""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling.detokenizer import IncrementalDetokenizer, byte_run_token_ids
from engine.sampling.stopping import Stop, StopChecker
from engine.sampling_params import SamplingParams
from need import need
from sp_tokenizers import BUILDERS, CORPUS, SAMPLE_TEXT

REPLACEMENT = "\ufffd"
EXAMPLES = settings(max_examples=120, deadline=None)


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def sp_tokenizer(request, tmp_path_factory):
    if request.param == "sentencepiece":
        need(all(importlib.util.find_spec(m) for m in ("sentencepiece", "google.protobuf")),
             "sentencepiece and protobuf (the dev extra) train the real SentencePiece model")
    return BUILDERS[request.param](tmp_path_factory.mktemp(request.param))


def decode(tokenizer, ids, skip):
    return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def expected_text(tokenizer, prompt, output, skip):
    """decode(output); after a prompt, the text the output adds to it (its
    SentencePiece leading space kept), unless the two do not join up."""
    alone = decode(tokenizer, output, skip)
    if not prompt:
        return alone
    before = decode(tokenizer, prompt, skip)
    whole = decode(tokenizer, prompt + output, skip)
    if before.endswith(REPLACEMENT) or not whole.startswith(before):
        return alone
    return whole[len(before):]


def stream(detokenizer, output, hold_back=0):
    """One token at a time, a delta after each, then the finished flush.
    Returns every delta; checks that nothing streamed is taken back."""
    deltas = []
    for token_id in output:
        detokenizer.update([token_id])
        deltas.append(detokenizer.get_delta(finished=False, hold_back=hold_back))
        assert detokenizer.output_text.startswith("".join(deltas))
    deltas.append(detokenizer.get_delta(finished=True, hold_back=hold_back))
    return deltas


def check_stream(tokenizer, prompt, output, skip, hold_back=0):
    expected = expected_text(tokenizer, prompt, output, skip)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas = stream(detokenizer, output, hold_back)
    context = (tokenizer.convert_ids_to_tokens(prompt[-6:]), tokenizer.convert_ids_to_tokens(output))
    assert "".join(deltas) == expected, context
    assert detokenizer.output_text == expected, context
    # Each delta was final: the stream so far is a prefix of the full text.
    assert all(expected.startswith("".join(deltas[:i])) for i in range(len(deltas)))
    return deltas


# -- random texts and random token ids ---------------------------------------------------

# Words the vocabularies know, words spelled in byte-fallback tokens, any
# character at all; joined by the spacing SentencePiece turns into "▁".
WORDS = st.one_of(
    st.sampled_from(sorted(set(SAMPLE_TEXT.split() + CORPUS[0].split()))),
    st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=3),
)
TEXTS = st.lists(st.tuples(WORDS, st.sampled_from([" ", " ", "", "  ", "\n", " ▁"])),
                 max_size=12).map(lambda parts: "".join(w + sep for w, sep in parts))


@EXAMPLES
@given(data=st.data(), text=TEXTS, skip=st.booleans(),
       hold_back=st.integers(0, 3), with_prompt=st.booleans())
def test_random_texts_stream_exactly(sp_tokenizer, data, text, skip, hold_back, with_prompt):
    ids = sp_tokenizer.encode(text, add_special_tokens=False)
    cut = data.draw(st.integers(0, len(ids)), label="cut")
    prompt = [sp_tokenizer.bos_token_id] + ids[:cut] if with_prompt else []
    check_stream(sp_tokenizer, prompt, ids[cut:], skip, hold_back)


@EXAMPLES
@given(data=st.data(), skip=st.booleans(), hold_back=st.integers(0, 3))
def test_random_token_ids_stream_exactly(sp_tokenizer, data, skip, hold_back):
    """Any ids, biased to byte-fallback and special tokens: invalid byte runs,
    runs broken by skipped special tokens, characters cut at either end."""
    byte_ids = sorted(byte_run_token_ids(sp_tokenizer))
    some_id = st.one_of(
        st.integers(0, len(sp_tokenizer) - 1),
        st.sampled_from(byte_ids),
        st.sampled_from(sp_tokenizer.all_special_ids),
        st.sampled_from(sp_tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False)),
    )
    prompt = data.draw(st.lists(some_id, max_size=8), label="prompt")
    output = data.draw(st.lists(some_id, max_size=25), label="output")
    check_stream(sp_tokenizer, prompt, output, skip, hold_back)


@pytest.mark.parametrize("skip", [True, False])
def test_slices_of_the_sample_text(sp_tokenizer, skip):
    """Every prompt/output boundary of the sample text, output cut at the end
    too: outputs that begin or end inside a byte-fallback character."""
    ids = sp_tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False)
    bos = [sp_tokenizer.bos_token_id]
    for cut in range(0, len(ids), 3):
        for prompt in ([], bos + ids[:cut]):
            check_stream(sp_tokenizer, prompt, ids[cut : cut + 25], skip)


# -- byte-fallback runs ----------------------------------------------------------------


def byte_tokens(tokenizer, data: bytes):
    return tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in data])


def test_sentencepiece_tokenizers_have_byte_runs(sp_tokenizer):
    assert len(byte_run_token_ids(sp_tokenizer)) == 256
    tokens = sp_tokenizer.convert_ids_to_tokens(sp_tokenizer.encode(SAMPLE_TEXT))
    assert sum(token.startswith("<0x") for token in tokens) > 20


def test_a_byte_run_streams_when_it_closes(sp_tokenizer):
    """Valid characters of a run are held until a token that is not a byte
    ends it: a later byte could still turn the whole run into U+FFFD."""
    space = sp_tokenizer.convert_tokens_to_ids("▁")
    prompt = sp_tokenizer.encode("the dog", add_special_tokens=False)
    output = byte_tokens(sp_tokenizer, "é🤖".encode()) + [space]
    deltas = check_stream(sp_tokenizer, prompt, output, skip=True)
    assert deltas == [""] * 6 + ["é🤖 ", ""]


def test_a_byte_run_made_invalid_by_its_last_byte(sp_tokenizer):
    space = sp_tokenizer.convert_tokens_to_ids("▁")
    output = byte_tokens(sp_tokenizer, "é".encode() + b"\xff") + [space]
    deltas = check_stream(sp_tokenizer, [], output, skip=True)
    assert "".join(deltas).startswith(REPLACEMENT * 3)  # the "é" went too


def test_output_cut_inside_a_character_after_complete_ones(sp_tokenizer):
    """max_tokens stops "é🤖" one byte short: the full decode renders the
    whole run as U+FFFD, and so does the stream."""
    output = byte_tokens(sp_tokenizer, "é🤖".encode()[:-1])
    deltas = check_stream(sp_tokenizer, sp_tokenizer.encode("a dog"), output, skip=True)
    assert "".join(deltas) == REPLACEMENT * 5


@pytest.mark.parametrize("skip", [True, False])
def test_a_special_token_inside_a_byte_run(sp_tokenizer, skip):
    special = sp_tokenizer.eos_token_id
    output = byte_tokens(sp_tokenizer, b"\xc3") + [special] + byte_tokens(sp_tokenizer, b"\xa9")
    deltas = check_stream(sp_tokenizer, [], output, skip)
    joined = "".join(deltas)
    assert joined == ("é" if skip else f"{REPLACEMENT}{sp_tokenizer.eos_token}{REPLACEMENT}")


def test_prompt_ending_in_a_long_byte_run(sp_tokenizer):
    """The window starts before the prompt's last run, however long, so the
    output's bytes join it as they do in a full decode."""
    prompt = sp_tokenizer.encode("dog 🎉🎉🎉🎉", add_special_tokens=False)
    for tail in ["🎉", " end", "\u0301 end"]:  # combining accent: still its own bytes
        check_stream(sp_tokenizer, prompt, sp_tokenizer.encode(tail, add_special_tokens=False)[1:],
                     skip=True)
    check_stream(sp_tokenizer, prompt, byte_tokens(sp_tokenizer, b"\xff"), skip=True)


# -- leading spaces ------------------------------------------------------------------------


def test_leading_space_of_the_first_output_token(sp_tokenizer):
    the = sp_tokenizer.convert_tokens_to_ids(["▁the"])
    prompt = sp_tokenizer.encode("hello", add_special_tokens=False)
    assert "".join(check_stream(sp_tokenizer, prompt, the, skip=True)) == " the"
    alone = "".join(check_stream(sp_tokenizer, [], the, skip=True))
    assert alone == ("the" if sp_tokenizer.tokenize("the") == ["▁the"] else " the")


def test_every_chunk_keeps_its_spaces(sp_tokenizer):
    """Decoding each token alone would drop the "▁" of every word; the
    window's left context keeps them."""
    ids = sp_tokenizer.encode("the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    deltas = check_stream(sp_tokenizer, [], ids, skip=True)
    assert "".join(deltas).count(" ") == 8


# -- cost ------------------------------------------------------------------------------------


def test_decode_windows_stay_small(sp_tokenizer):
    calls = []

    class CountingTokenizer:
        def __getattr__(self, name):
            return getattr(sp_tokenizer, name)

        def __len__(self):
            return len(sp_tokenizer)

        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return sp_tokenizer.decode(ids, **kwargs)

    ids = sp_tokenizer.encode(SAMPLE_TEXT * 10, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(CountingTokenizer(), ids[:7])
    calls.clear()
    assert "".join(stream(detokenizer, ids)) == expected_text(sp_tokenizer, ids[:7], ids, True)
    longest_run = max(len(run) for run in "".join(
        "b" if t.startswith("<0x") else " " for t in sp_tokenizer.convert_ids_to_tokens(ids)).split())
    assert max(calls) <= longest_run + 12
    assert len(calls) <= 2 * len(ids)  # byte tokens of an open run decode nothing


# -- stop strings over byte runs (engine/sampling/stopping.py) --------------------------


def run_with_stops(tokenizer, prompt, output, **params):
    """Check and stream tokens as the engine does; (deltas, stop, text)."""
    params = SamplingParams(**{"max_tokens": 100, **params})
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, params.skip_special_tokens)
    checker = StopChecker(params, frozenset([tokenizer.eos_token_id]), 10_000, len(prompt),
                          detokenizer)
    deltas, stop = [], None
    for n, token_id in enumerate(output, start=1):
        stop = checker.check(token_id, n)
        deltas.append(detokenizer.get_delta(stop is not None, checker.held_back_length()))
        if stop is not None:
            break
    else:
        deltas.append(detokenizer.get_delta(True))
    return deltas, stop, detokenizer.output_text


@pytest.mark.parametrize("ending", ["text", "eos", "max_tokens"])
def test_a_stop_string_in_a_byte_run_never_streams(sp_tokenizer, ending):
    """A run's text waits for the token after it, or for the end of the
    sequence: either way the stop string in it is found and cut."""
    output = sp_tokenizer.encode("a 🦀", add_special_tokens=False)  # not in the corpus
    assert sp_tokenizer.convert_ids_to_tokens(output)[-1].startswith("<0x")
    params = {"stop": ["🦀"]}
    if ending == "text":
        output += sp_tokenizer.encode(" more", add_special_tokens=False)
    elif ending == "eos":
        output += [sp_tokenizer.eos_token_id]
    else:
        params["max_tokens"] = len(output)
    prompt = sp_tokenizer.encode("the dog", add_special_tokens=False)
    before_stop = expected_text(sp_tokenizer, prompt, output, True).split("🦀")[0]
    assert before_stop.endswith("a ")
    deltas, stop, text = run_with_stops(sp_tokenizer, prompt, output, **params)
    assert stop == Stop("stop", "🦀")
    assert "".join(deltas) == text == before_stop
    deltas, stop, text = run_with_stops(
        sp_tokenizer, prompt, output, include_stop_str_in_output=True, **params)
    assert "".join(deltas) == text == before_stop + "🦀" and stop == Stop("stop", "🦀")


def test_eos_after_a_byte_run_without_stop_strings(sp_tokenizer):
    output = sp_tokenizer.encode("a 🦀", add_special_tokens=False) + [sp_tokenizer.eos_token_id]
    deltas, stop, text = run_with_stops(sp_tokenizer, [], output, stop=["zzz"])
    assert stop == Stop("stop") and "".join(deltas) == text
    assert text == expected_text(sp_tokenizer, [], output[:-1], True)
    assert deltas[-2:] == ["", text[-len("🦀"):]]  # the run's text came with the end


# -- through the engine ------------------------------------------------------------------


@pytest.mark.usefixtures("single_thread")
def test_engine_streams_exact_text_with_a_sentencepiece_tokenizer(tmp_path_factory):
    """A tiny random Llama on the Llama-style tokenizer, sampled at
    temperature 1: half its vocabulary is byte tokens, so outputs are full
    of byte runs, valid or not. Streamed deltas add up to the final text,
    which is the decode of the output token ids."""
    from engine import LLM
    from tiny_models import make_tiny_model

    folder = tmp_path_factory.mktemp("sp-llama")
    tokenizer = BUILDERS["llama"](folder)
    make_tiny_model(folder, folder, vocab_size=len(tokenizer), initializer_range=0.02)
    engine = LLM(str(folder), dtype="float32", block_size=16, max_model_len=128,
                 num_gpu_blocks_override=64, seed=0).engine
    for i in range(6):
        engine.add_request(str(i), "the quick brown fox", SamplingParams(
            temperature=1.0, seed=i, max_tokens=30, skip_special_tokens=i % 2 == 0))
    streamed, final = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] = streamed.get(out.request_id, "") + out.outputs[0].delta_text
            final[out.request_id] = out
    for request_id, out in final.items():
        ids = out.outputs[0].token_ids
        if out.outputs[0].finish_reason == "stop":  # on EOS, whose text is not shown
            assert ids[-1] == tokenizer.eos_token_id
            ids = ids[:-1]
        expected = expected_text(tokenizer, out.prompt_token_ids, ids, int(request_id) % 2 == 0)
        assert streamed[request_id] == out.outputs[0].text == expected
    byte_tokens = [t for o in final.values() for t in o.outputs[0].token_ids
                   if t in byte_run_token_ids(tokenizer)]
    assert len(byte_tokens) > 20
