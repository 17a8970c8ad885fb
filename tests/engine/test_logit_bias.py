"""logit_bias in the sampler: added to the logits before greedy and random choices."""

import torch

from engine.sampling.sampler import Sampler, SamplingRequest, apply_logit_bias, apply_penalties
from engine.sampling_params import FLOAT32_TINY, SamplingParams


def request(**params) -> SamplingRequest:
    return SamplingRequest(SamplingParams(**params), None, prompt_token_ids=[1, 2],
                           output_token_ids=[3])


def test_bias_is_added_per_row_and_out_of_vocabulary_ids_are_ignored():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    rows = [request(logit_bias={2: 5.0, 9: -3.0, 50: 1.0}), request(), request(logit_bias={0: 1.5})]
    biased = apply_logit_bias(logits, rows)
    expected = logits.clone()
    expected[0, 2] += 5.0
    expected[0, 9] -= 3.0
    expected[2, 0] += 1.5
    torch.testing.assert_close(biased, expected, rtol=0, atol=0)
    assert apply_logit_bias(logits, [request()] * 3) is logits  # nothing to add: no copy


def test_bias_steers_greedy_and_sampled_choices():
    vocab = 64
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1))
    forced = int(logits[0].argmin())
    sampler = Sampler(vocab, seed=0)
    out = sampler(logits, [request(temperature=0, logit_bias={forced: 100}),
                           request(temperature=1.0, seed=3, logit_bias={forced: 100})])
    assert out.token_ids == [forced, forced]
    best = int(logits[0].argmax())
    banned = sampler(logits[:1], [request(temperature=0, logit_bias={best: -100})])
    assert banned.token_ids[0] != best


def test_the_smallest_repetition_penalty_keeps_logits_finite():
    logits = torch.tensor([[30.0, -30.0, 1.0]])
    penalised = apply_penalties(logits, [[0, 1]], [[]], [FLOAT32_TINY], [0.0], [0.0])
    assert torch.isfinite(penalised).all(), penalised
    assert penalised[0, 0] > penalised[0, 2] > penalised[0, 1]
