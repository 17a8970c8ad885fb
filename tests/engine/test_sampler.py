import zlib

import pytest
import torch

from engine.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRequest,
    apply_banned_tokens,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    filtered_probs,
    make_generator,
    token_counts,
)
from engine.model.sampling_batch import build_sampling_batch
from engine.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledSequence

EOS = 2


# On a busy 2-core machine two OpenMP threads make small ops wait on each other.
pytestmark = pytest.mark.usefixtures("single_thread")


def request(params=None, generator=None, prompt=(), output=(), banned=()):
    return SamplingRequest(
        params=params or SamplingParams(),
        generator=generator,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        banned_token_ids=frozenset(banned),
    )


def random_logits(rows, vocab, seed):
    return torch.randn(rows, vocab, generator=make_generator(seed)) * 3


# -- output shape and basics -------------------------------------------------------


def test_empty_batch():
    out = Sampler(8)(torch.zeros(0, 8), [])
    assert out == SamplerOutput([], [], [])


def test_rejects_wrong_shapes():
    sampler = Sampler(8)
    with pytest.raises(ValueError, match="shape"):
        sampler(torch.zeros(2, 8), [request()])
    with pytest.raises(ValueError, match="vocab_size=8"):
        sampler(torch.zeros(1, 7), [request()])


def test_input_logits_are_not_modified():
    logits = random_logits(3, 16, seed=0)
    before = logits.clone()
    params = SamplingParams(
        temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.5,
        frequency_penalty=1.0, presence_penalty=1.0, min_tokens=3,
    )
    row = request(params, prompt=[1, 2], output=[3], banned=[EOS])
    Sampler(16, seed=0)(logits, [row] * 3)
    assert torch.equal(logits, before)


def test_padded_vocab_columns_are_never_chosen():
    logits = torch.zeros(2, 12)
    logits[:, 10:] = 100.0  # LM-head padding beyond the real vocabulary
    logits[:, 4] = 1.0
    out = Sampler(10, seed=0)(
        logits, [request(SamplingParams(temperature=0)), request(SamplingParams(top_k=1))]
    )
    assert out.token_ids == [4, 4]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_accepts_any_float_dtype(dtype):
    logits = random_logits(2, 32, seed=1)
    out = Sampler(32)(logits.to(dtype), [request(SamplingParams(temperature=0))] * 2)
    assert out.token_ids == logits.to(dtype).float().argmax(dim=-1).tolist()


# -- greedy and filtering ------------------------------------------------------------


def test_greedy_is_argmax():
    logits = random_logits(6, 50, seed=2)
    out = Sampler(50)(logits, [request(SamplingParams(temperature=0))] * 6)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6
    assert out.top_logprobs == [None] * 6


def test_greedy_ties_go_to_lowest_id():
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0, 5.0]])
    out = Sampler(5)(logits, [request(SamplingParams(temperature=0))])
    assert out.token_ids == [1]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0),
        SamplingParams(top_k=1, temperature=5.0),
    ],
    ids=["top_k=1", "tiny top_p", "min_p=1", "top_k=1 hot"],
)
def test_degenerate_filters_equal_greedy(params):
    logits = random_logits(64, 100, seed=3)
    sampler = Sampler(100, seed=0)
    seeded = [request(params, make_generator(i)) for i in range(32)]
    unseeded = [request(params) for _ in range(32)]
    out = sampler(logits, seeded + unseeded)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_top_p_masks_exactly():
    # probs of row 0 are 0.4, 0.3, 0.2, 0.1 (in token order 3, 0, 2, 1)
    probs = torch.tensor([[0.3, 0.1, 0.2, 0.4]] * 5)
    logits = probs.log()
    top_k = torch.tensor([0, 2, 0, 3, 3])
    top_p = torch.tensor([1.0, 1.0, 0.6, 0.8, 0.75])
    kept = apply_top_k_top_p(logits, top_k, top_p).isfinite()
    assert kept.tolist() == [
        [True, True, True, True],  # disabled
        [True, False, False, True],  # best two
        [True, False, False, True],  # 0.4 < 0.6 keeps the second; 0.7 >= 0.6 stops
        # top-p sees the top-k survivors renormalised: mass above the third is
        # (0.4 + 0.3) / 0.9 = 0.78, below 0.8 (kept) but not below 0.75.
        [True, False, True, True],
        [True, False, False, True],
    ]
    # Kept logits keep their values.
    assert torch.equal(apply_top_k_top_p(logits, top_k, top_p)[kept], logits[kept])


def test_top_p_keeps_at_least_one_token_and_breaks_ties_by_id():
    logits = torch.zeros(1, 6)
    kept = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([1e-6])).isfinite()
    assert kept.tolist() == [[True, False, False, False, False, False]]
    kept = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0])).isfinite()
    assert kept.tolist() == [[True, True, False, False, False, False]]


def test_top_p_stops_as_soon_as_the_mass_reaches_p():
    # Two tokens of exactly 0.5: the first alone already reaches p = 0.5.
    kept = apply_top_k_top_p(torch.zeros(1, 2), torch.tensor([0]), torch.tensor([0.5]))
    assert kept.isfinite().tolist() == [[True, False]]


def test_min_p_zeroes_relative_to_best():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    filtered = apply_min_p(probs, torch.tensor([0.5, 0.25]))
    expected = torch.tensor([[0.5, 0.3, 0.0, 0.0], [0.5, 0.3, 0.15, 0.0]])
    assert torch.equal(filtered, expected)


def reference_probs(logits_row, params):
    """The documented order, one row, written out: temperature, top-k, top-p, min-p.

    float64, one token at a time: nothing shared with filtered_probs but the order.
    """
    probs = (logits_row.double() / params.temperature).softmax(dim=-1)
    order = probs.argsort(descending=True).tolist()
    if params.top_k > 0:
        order = order[: params.top_k]
    mass = probs[order].sum().item()
    kept, above = [], 0.0
    for token in order:
        # Renormalised over the top-k survivors, as top-p sees them.
        if params.top_p < 1 and above >= params.top_p:
            break
        kept.append(token)
        above += probs[token].item() / mass
    best = probs[kept].max().item()
    kept = [token for token in kept if probs[token].item() >= params.min_p * best]
    expected = torch.zeros_like(probs)
    expected[kept] = probs[kept] / probs[kept].sum()
    return expected


def random_params(generator, vocab):
    """Filter settings for one row; each filter is off in some rows."""

    def draw() -> float:
        return torch.rand(1, generator=generator).item()

    return SamplingParams(
        # Not colder than 0.25: with these logits no kept token underflows
        # float32, so "kept" means the same in both pipelines.
        temperature=0.25 + 1.75 * draw(),
        top_k=0 if draw() < 0.3 else 1 + int(draw() * vocab),
        top_p=1.0 if draw() < 0.3 else 0.05 + 0.95 * draw(),
        min_p=0.0 if draw() < 0.3 else 0.3 * draw(),
    )


@pytest.mark.parametrize("seed", range(5))
def test_filtered_probs_follow_the_documented_order(seed):
    rows, vocab = 32, 300
    generator = make_generator(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 2
    params = [random_params(generator, vocab) for _ in range(rows)]
    probs = filtered_probs(logits, params)
    for row, row_params in enumerate(params):
        expected = reference_probs(logits[row], row_params)
        got = probs[row].double()
        where = (seed, row, row_params)
        assert torch.equal(got > 0, expected > 0), where
        assert torch.allclose(got / got.sum(), expected, rtol=1e-4, atol=1e-7), where


def test_temperature_comes_before_top_p():
    # At T=1 the probabilities are 0.7, 0.25, 0.05: top_p=0.9 needs two tokens.
    # At T=0.3 they become ~0.969, 0.031, 0.000: the first alone reaches 0.9.
    logits = torch.tensor([[0.7, 0.25, 0.05]]).log()
    at_one = filtered_probs(logits, [SamplingParams(temperature=1.0, top_p=0.9)])
    assert (at_one > 0).tolist() == [[True, True, False]]
    cold = filtered_probs(logits, [SamplingParams(temperature=0.3, top_p=0.9)])
    assert (cold > 0).tolist() == [[True, False, False]]


def sample_counts(logits_row, params, draws, seed=0):
    """Token frequencies over `draws` unseeded rows of one sampler call."""
    sampler = Sampler(logits_row.shape[-1], seed=seed)
    logits = logits_row.expand(draws, -1)
    out = sampler(logits, [request(params)] * draws)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.shape[-1])


def test_filters_restrict_the_sampled_set():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = probs.log()[None, :]
    draws = 4000
    top_k = sample_counts(logits, SamplingParams(top_k=2), draws)
    assert top_k.nonzero().flatten().tolist() == [1, 3]
    top_p = sample_counts(logits, SamplingParams(top_p=0.8), draws)
    assert top_p.nonzero().flatten().tolist() == [1, 3, 4]
    min_p = sample_counts(logits, SamplingParams(min_p=0.3), draws)
    assert min_p.nonzero().flatten().tolist() == [1, 3, 4]


def test_frequencies_match_probabilities():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = 20000
    counts = sample_counts(probs.log()[None, :], SamplingParams(), draws)
    assert torch.allclose(counts / draws, probs, atol=0.015)


def test_temperature_sharpens_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = 20000
    counts = sample_counts(probs.log()[None, :], SamplingParams(temperature=0.5), draws)
    expected = probs**2 / (probs**2).sum()  # p^(1/T), renormalised
    assert torch.allclose(counts / draws, expected, atol=0.015)


def test_top_k_renormalises_kept_tokens():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = 20000
    counts = sample_counts(probs.log()[None, :], SamplingParams(top_k=2), draws)
    assert torch.allclose(counts / draws, torch.tensor([0, 0, 3 / 7, 4 / 7]), atol=0.015)


def test_seeded_generator_frequencies_match_probabilities():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log()[None, :]
    sampler = Sampler(4)
    generator = make_generator(1234)
    tokens = [sampler(logits, [request(generator=generator)]).token_ids[0] for _ in range(3000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=4)
    assert torch.allclose(counts / len(tokens), probs, atol=0.03)


# -- reproducibility -----------------------------------------------------------------


def step_logits(step, name, vocab):
    """One sequence's logits at one decode step: a function of the sequence's
    name and the step only, never of its batch position."""
    return random_logits(1, vocab, seed=1000 * zlib.crc32(name.encode()) + step)[0]


def run_decode(batch_layout, steps=12, vocab=300, sampler_seed=None):
    """Decode `steps` tokens for every row of `batch_layout`.

    Each entry is (name, params, seed or None). Returns tokens per name.
    """
    sampler = Sampler(vocab, seed=sampler_seed)
    rows = []
    for name, params, seed in batch_layout:
        generator = None if seed is None else make_generator(seed)
        rows.append((name, request(params, generator, prompt=[1, 2, 3])))
    tokens = {name: [] for name, _ in rows}
    for step in range(steps):
        logits = torch.stack([step_logits(step, name, vocab) for name, _ in rows])
        out = sampler(logits, [req for _, req in rows])
        for (name, req), token in zip(rows, out.token_ids):
            tokens[name].append(token)
            req.output_token_ids.append(token)
    return tokens


TARGET = ("target", SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01,
                                   repetition_penalty=1.1, frequency_penalty=0.2), 42)


def test_seeded_request_is_reproducible_across_runs():
    assert run_decode([TARGET])["target"] == run_decode([TARGET])["target"]


def test_seeded_request_ignores_batch_composition_and_position():
    alone = run_decode([TARGET])["target"]
    others = [
        ("seeded_other", SamplingParams(temperature=1.3), 7),
        ("unseeded", SamplingParams(temperature=1.0), None),
        ("greedy", SamplingParams(temperature=0), None),
        ("unseeded_topk", SamplingParams(top_k=3), None),
        ("seeded_min_p", SamplingParams(min_p=0.2, logprobs=3), 9),
    ]
    for layout in (
        [TARGET] + others,
        others + [TARGET],
        others[:2] + [TARGET] + others[2:],
        [others[2], TARGET],  # only a greedy neighbour: a different code path
        [others[1], TARGET],
    ):
        assert run_decode(layout, sampler_seed=0)["target"] == alone
        assert run_decode(layout, sampler_seed=1)["target"] == alone


def test_different_seeds_give_different_sequences():
    a = run_decode([("a", SamplingParams(), 1)])["a"]
    b = run_decode([("a", SamplingParams(), 2)])["a"]
    assert a != b


def test_sampler_seed_makes_unseeded_rows_reproducible():
    layout = [("u", SamplingParams(), None), ("v", SamplingParams(top_p=0.9), None)]
    assert run_decode(layout, sampler_seed=5) == run_decode(layout, sampler_seed=5)
    assert run_decode(layout, sampler_seed=5) != run_decode(layout, sampler_seed=6)


def test_generator_advances_by_one_fixed_draw_per_sampled_token():
    vocab = 64
    generator = make_generator(3)
    Sampler(vocab)(random_logits(1, vocab, 0), [request(generator=generator)])
    reference = make_generator(3)
    torch.empty(vocab).uniform_(generator=reference)
    assert torch.equal(generator.get_state(), reference.get_state())


def test_greedy_rows_do_not_consume_their_generator():
    generator = make_generator(3)
    state = generator.get_state()
    params = SamplingParams(temperature=0)
    Sampler(16)(random_logits(1, 16, 0), [request(params, generator)])
    assert torch.equal(generator.get_state(), state)


# -- penalties -----------------------------------------------------------------------


def test_token_counts():
    counts = token_counts([[1, 1, 3], [], [0, 4, 4, 4, 99, -1]], vocab_size=5)
    assert counts.tolist() == [
        [0, 2, 0, 1, 0],
        [0, 0, 0, 0, 0],
        [1, 0, 0, 0, 3],  # 99 and -1 are out of the vocabulary and dropped
    ]


def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    out = apply_penalties(
        logits,
        prompt_token_ids=[[0, 5]],
        output_token_ids=[[1, 1, 2]],
        repetition_penalty=[2.0],
        frequency_penalty=[0.5],
        presence_penalty=[0.25],
    )
    # token 0: prompt only, positive -> /2; no frequency/presence (prompt only)
    # token 1: output x2, negative -> *2 = -2, then -0.5*2 - 0.25
    # token 2: output x1, positive -> /2 = 0.25, then -0.5 - 0.25
    # token 3, 4: unseen, unchanged; token 5: prompt only, 0 * 2 = 0
    assert out.tolist() == [[1.0, -3.25, -0.5, 3.0, -2.0, 0.0]]
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]]  # input untouched


def test_repetition_penalty_below_one_favours_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 1.0]])
    out = apply_penalties(logits, [[0]], [[1]], [0.5], [0.0], [0.0])
    assert out.tolist() == [[4.0, -0.5, 1.0]]


def test_negative_frequency_and_presence_penalties_reward_repeats():
    logits = torch.zeros(1, 3)
    out = apply_penalties(logits, [[]], [[2, 2, 2]], [1.0], [-0.5], [-1.0])
    assert out.tolist() == [[0.0, 0.0, 2.5]]


def test_penalties_are_per_row():
    logits = torch.ones(2, 3)
    out = apply_penalties(logits, [[0], [0]], [[1], [1]], [2.0, 1.0], [0.0, 1.0], [0.0, 0.0])
    assert out.tolist() == [[0.5, 0.5, 1.0], [1.0, 0.0, 1.0]]


def test_sampler_applies_penalties_only_to_rows_that_ask():
    logits = torch.tensor([[1.0, 3.0, 2.0]] * 2)
    greedy = SamplingParams(temperature=0)
    penalised = SamplingParams(temperature=0, frequency_penalty=1.5)
    out = Sampler(3)(
        logits, [request(greedy, output=[1]), request(penalised, output=[1])]
    )
    assert out.token_ids == [1, 2]


def test_repetition_penalty_counts_prompt_tokens_in_sampler():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert Sampler(3)(logits, [request(params, prompt=[1])]).token_ids == [2]
    # Frequency/presence penalties ignore the prompt.
    params = SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    assert Sampler(3)(logits, [request(params, prompt=[1])]).token_ids == [1]


# -- banned tokens (stopping.py decides which: min_tokens) ---------------------------


def eos_favoured_logits(rows=1):
    logits = torch.zeros(rows, 8)
    logits[:, EOS] = 10.0
    logits[:, 5] = 9.0
    logits[:, 6] = 8.0
    return logits


def test_banned_tokens_are_masked_exactly():
    params = SamplingParams(temperature=0)
    masked = apply_banned_tokens(eos_favoured_logits(), [request(params, banned=[EOS, 3, 5])])
    assert sorted(masked[0].isinf().nonzero().flatten().tolist()) == [EOS, 3, 5]
    out = Sampler(8)(eos_favoured_logits(), [request(params, banned=[EOS, 5])])
    assert out.token_ids == [6]


def test_banned_tokens_are_per_row():
    params = SamplingParams(temperature=0)
    rows = [request(params, banned=[EOS]), request(params), request(params, banned=[EOS, 5])]
    assert Sampler(8)(eos_favoured_logits(3), rows).token_ids == [5, EOS, 6]


def test_banned_tokens_ignore_out_of_vocab_ids_and_short_circuit():
    logits = eos_favoured_logits()
    masked = apply_banned_tokens(logits, [request(banned=[100, 200])])
    assert torch.equal(masked, logits)
    assert apply_banned_tokens(logits, [request()]) is logits


def test_banned_tokens_apply_to_sampled_rows():
    logits = eos_favoured_logits(500)
    out = Sampler(8, seed=0)(logits, [request(SamplingParams(), banned=[EOS])] * 500)
    assert EOS not in out.token_ids


# -- logprobs ------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits():
    vocab = 40
    logits = random_logits(3, vocab, seed=7)
    raw = logits.log_softmax(dim=-1)
    params = [
        SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.7, logprobs=5),
        SamplingParams(temperature=0, frequency_penalty=2.0, logprobs=0),
        SamplingParams(temperature=0.8),
    ]
    requests = [
        request(params[0], make_generator(0), prompt=[1, 2], output=[3]),
        request(params[1], output=[int(logits[1].argmax())]),
        request(params[2]),
    ]
    out = Sampler(vocab, seed=0)(logits, requests)
    for row in (0, 1):
        token = out.token_ids[row]
        assert out.logprobs[row] == pytest.approx(raw[row, token].item(), abs=1e-6)
    assert out.logprobs[2] is None and out.top_logprobs[2] is None
    assert out.top_logprobs[1] == []
    top = out.top_logprobs[0]
    values, ids = raw[0].topk(5)
    assert [token for token, _ in top] == ids.tolist()
    assert [value for _, value in top] == pytest.approx(values.tolist(), abs=1e-6)
    assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
    assert all(isinstance(token, int) and isinstance(value, float) for token, value in top)


def test_logprobs_with_different_k_per_row():
    logits = random_logits(2, 30, seed=8)
    requests = [request(SamplingParams(temperature=0, logprobs=k)) for k in (2, 7)]
    out = Sampler(30)(logits, requests)
    assert [len(top) for top in out.top_logprobs] == [2, 7]
    assert out.top_logprobs[0][0][0] == out.token_ids[0]  # greedy: the best token


# -- the sampler's batch, as the runner builds it from the scheduler's output ----------


def scheduled(seq_id, num_new, params, output=(), generator=None):
    return ScheduledSequence(
        seq_id=seq_id, token_ids=[9] * num_new, start_position=3, block_table=[1, 2],
        sampling=params, generator=generator, prompt_token_ids=[9, 9, 9],
        output_token_ids=list(output),
    )


def test_sampling_batch_rows_ids_and_requests():
    generator = make_generator(0)
    greedy = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])
    ordered = [
        scheduled(10, 1, greedy, output=[4]),  # decode, row 0
        scheduled(11, 1, None),  # a one-token chunk short of the prompt's end, row 1
        scheduled(12, 4, SamplingParams(), generator=generator),  # prefill, rows 2..5
        scheduled(13, 3, None),  # a prefill chunk short of the prompt's end
    ]
    batch = build_sampling_batch(ordered, frozenset({EOS}))
    assert batch.rows == [0, 5]
    assert batch.seq_ids == [10, 12]
    first, second = batch.requests
    assert first.params is greedy and first.generator is None
    assert first.prompt_token_ids is ordered[0].prompt_token_ids
    assert first.output_token_ids is ordered[0].output_token_ids
    assert set(first.banned_token_ids) == {EOS, 5}  # one output, min_tokens=2
    assert second.generator is generator and set(second.banned_token_ids) == set()


def test_sampling_batch_of_a_step_that_samples_nothing():
    batch = build_sampling_batch([scheduled(1, 4, None)], frozenset({EOS}))
    assert (batch.rows, batch.seq_ids, batch.requests) == ([], [], [])
