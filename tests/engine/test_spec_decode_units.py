"""Speculative decoding, exact CPU tier: proposers, the adaptive budget, the
config, the scheduler's draft slots and their rollback, and verification."""

from __future__ import annotations

import argparse
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from engine.args import add_engine_args, config_from_args
from engine.config import EngineConfig, SpeculativeConfig
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.sampling.sampler import Sampler, SamplingRequest
from engine.sampling.speculative import Drafted, verify
from engine.sampling_params import SamplingParams
from engine.spec_decode.ngram import NgramIndex
from engine.spec_decode.speculator import PROBE_EVERY, Speculator
from engine.spec_decode.suffix import SuffixCache


# -- proposers -------------------------------------------------------------------------
def test_ngram_drafts_what_followed_the_latest_earlier_occurrence():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    # (1, 2, 3) occurred twice before; the latest was followed by 5, 7
    assert index.propose(tokens, 2) == [5, 7]
    # past the context's end the copy reads on into its own draft (5 7 1 2 3 5 7 ...)
    assert index.propose(tokens, 7) == [5, 7, 1, 2, 3, 5, 7]


def test_ngram_prefers_the_longest_match_and_respects_the_minimum():
    tokens = [5, 6, 7, 8, 6, 7, 9, 4, 6, 7]
    assert NgramIndex(1, 3).propose(tokens, 1) == [9]  # (6, 7): latest is followed by 9
    assert NgramIndex(3, 3).propose(tokens, 1) == []  # (4, 6, 7) never occurred before
    assert NgramIndex(1, 1).propose([1, 2, 3], 2) == []
    # a match only at n = min_n still drafts (min_n itself is tried)
    assert NgramIndex(2, 3).propose([1, 2, 3, 9, 2, 3], 1) == [9]
    assert NgramIndex(1, 1).propose([4, 5, 4], 1) == [5]


def test_ngram_index_grows_with_the_text_as_it_arrives():
    index = NgramIndex(2, 2)
    tokens = [1, 2, 3]
    assert index.propose(tokens, 2) == []
    tokens += [1, 2]
    assert index.propose(tokens, 2) == [3, 1]
    assert index.propose(tokens, 5) == [3, 1, 2, 3, 1]
    tokens += [4]
    assert index.propose(tokens, 2) == []  # (2, 4) is new
    tokens += [1, 2]
    assert index.propose(tokens, 3) == [4, 1, 2]  # the latest (1, 2) went on with 4


def suffix_config(**changes):
    return SpeculativeConfig(method="suffix", **changes)


def test_suffix_follows_the_likeliest_continuation_of_the_deepest_match():
    cache = SuffixCache(suffix_config(suffix_decoding_min_token_prob=0.0))
    handle = cache.start("r", [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    # after (1, 2): 3 twice, 4 once; after (1, 2, 3): 1 twice...
    assert cache.propose(handle, 4) == [3, 1]  # capped at the match's length (2)
    assert SuffixCache(suffix_config(suffix_decoding_max_spec_factor=4.0,
                                     suffix_decoding_min_token_prob=0.0)
                       ).propose(cache.start("s", [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]), 4) \
        == [3, 1, 2, 3]


def test_suffix_stops_when_the_path_gets_unlikely():
    text = [5, 1, 2, 5, 1, 3, 5, 1, 2, 9, 5, 1]
    # the deepest earlier match is (5, 1): then 2 (2 of 3), then 5 or 9 (1 of 2 each)
    def draft(min_prob):
        cache = SuffixCache(suffix_config(suffix_decoding_min_token_prob=min_prob,
                                          suffix_decoding_max_spec_factor=8.0))
        return cache.propose(cache.start("r", text), 8)
    assert draft(0.5) == [2]  # 2/3, then 1/3 < 0.5
    assert draft(0.3)[:3] == [2, 5, 1]  # 1/3 >= 0.3, and the path goes on as it went
    assert draft(0.7) == []


def test_suffix_follows_the_deepest_match_as_the_text_went():
    cache = SuffixCache(suffix_config(suffix_decoding_max_spec_factor=8.0))
    # (7, 1, 2, 7) occurred before and went on 1 3 7 1 2 7: one path, probability 1
    assert cache.propose(cache.start("r", [7, 1, 2, 7, 1, 3, 7, 1, 2, 7]), 8) == [1, 3, 7, 1, 2, 7]


def test_suffix_learns_from_finished_requests_and_forgets_the_oldest():
    cache = SuffixCache(suffix_config(suffix_decoding_max_cached_requests=1,
                                      suffix_decoding_min_token_prob=0.0,
                                      suffix_decoding_max_spec_factor=4.0))
    first = cache.start("a", [100])
    first.history = [100, 5, 6, 7, 8]
    cache.finish(first)  # its output 5 6 7 8 joins the global trie
    other = cache.start("b", [200, 5, 6])
    assert cache.propose(other, 4) == [7, 8]
    second = cache.start("c", [300])
    second.history = [300, 9, 9]
    cache.finish(second)  # the first request's output leaves the cache
    assert cache.propose(cache.start("d", [200, 5, 6]), 4) == []
    assert cache.global_root[1].keys() == {9}


# -- the speculator's budget --------------------------------------------------------------
def running_seq(seq_id=0, prompt=(1, 2, 3, 1, 2), outputs=(), max_tokens=64):
    seq = Sequence(seq_id, f"r{seq_id}", 0, list(prompt), SamplingParams(max_tokens=max_tokens))
    seq.output_token_ids = list(outputs)
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def test_speculator_drafts_for_decoding_sequences_within_their_room():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                        prompt_lookup_max=2), max_model_len=100)
    seq = running_seq()
    spec.propose([seq])
    assert seq.draft_token_ids == [3, 1, 2]
    short = running_seq(seq_id=1, max_tokens=2)  # one token left after this step's
    spec.propose([short])
    assert short.draft_token_ids == [3]
    prefilling = running_seq(seq_id=2)
    prefilling.num_computed_tokens = 1
    spec.propose([prefilling])
    assert prefilling.draft_token_ids == []


def test_speculator_steps_aside_for_a_large_batch():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                        disable_by_batch_size=2), max_model_len=100)
    seqs = [running_seq(i) for i in range(3)]
    spec.propose(seqs)
    assert all(seq.draft_token_ids == [] for seq in seqs)
    spec.propose(seqs[:2])
    assert all(seq.draft_token_ids for seq in seqs[:2])


def test_speculator_budget_adapts_and_probes_again_at_zero():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
                      max_model_len=100)
    seq = running_seq(prompt=[1, 2] * 10)
    spec.propose([seq])
    assert len(seq.draft_token_ids) == 4
    for budget in (2, 1, 0):  # drafts rejected outright halve the budget
        spec.record(seq.seq_id, len(seq.draft_token_ids), 0)
        spec.propose([seq])
        assert len(seq.draft_token_ids) == budget
    drafts = []
    for _ in range(PROBE_EVERY - 1):  # the PROBE_EVERY-th step at budget 0 probes
        spec.propose([seq])
        drafts.append(len(seq.draft_token_ids))
    assert drafts == [0] * (PROBE_EVERY - 2) + [1]
    spec.record(seq.seq_id, 1, 1)  # the probe was accepted: the budget grows again
    spec.propose([seq])
    assert len(seq.draft_token_ids) == 2
    stats = spec.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 8, 1)
    assert stats.accepted_per_position == [1, 0, 0, 0]


# -- the config --------------------------------------------------------------------------
def test_config_takes_vllms_json_and_names_what_it_refuses():
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert config.speculative_config == SpeculativeConfig("ngram", 3, 5, 5)
    assert SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=4).prompt_lookup_min == 4
    assert SpeculativeConfig(method="suffix").num_speculative_tokens == 24
    assert SpeculativeConfig(num_speculative_tokens=64).num_speculative_tokens == 64
    errors = {
        '{"method": "eagle", "num_speculative_tokens": 3}': "speculative_config.method",
        '{"method": "ngram"}': "speculative_config.num_speculative_tokens",
        '{"method": "ngram", "num_speculative_tokens": 3, "lookahead": 1}':
            "speculative_config.lookahead",
        '{"method": "ngram", "num_speculative_tokens": 0}':
            "speculative_config.num_speculative_tokens",
        # a row per drafted position in every step, a series each in /metrics
        '{"method": "ngram", "num_speculative_tokens": 100000}':
            "speculative_config.num_speculative_tokens=100000 must be an integer >= 1 and <= 64",
        '{"method": "suffix", "num_speculative_tokens": 8, '
        '"suffix_decoding_max_tree_depth": 65}':
            "speculative_config.suffix_decoding_max_tree_depth",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
        '"prompt_lookup_max": 2}': "speculative_config.prompt_lookup_min",
        '{"method": "suffix", "suffix_decoding_min_token_prob": 2}':
            "speculative_config.suffix_decoding_min_token_prob",
        "[1]": "speculative_config must be a JSON object",
        "{": "speculative_config is not valid JSON",
    }
    for text, named in errors.items():
        with pytest.raises(ValueError, match=named.replace(".", r"\.")):
            EngineConfig(speculative_config=text)


def test_the_flag_builds_the_same_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config",
                              '{"method": "suffix", "suffix_decoding_max_tree_depth": 8}'])
    config = config_from_args(args)
    assert config.speculative_config.suffix_decoding_max_tree_depth == 8
    assert config.speculative_config.num_speculative_tokens == 8


# -- the scheduler -----------------------------------------------------------------------
def scheduler(num_blocks=16, block_size=4, budget=64):
    config = SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=budget,
                             block_size=block_size, max_model_len=64,
                             schedule_conservativeness=0.0, scheduling_policy="fcfs", max_loras=1,
                             runner="generate")
    return Scheduler(config, BlockManager(num_blocks, block_size, enable_caching=True))


def decoding(sched, *prompts):
    """Sequences past their prefill, each with one output token (50)."""
    seqs = [Sequence(i, f"r{i}", 0, list(p), SamplingParams(max_tokens=32))
            for i, p in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    sched.update(out, {seq.seq_id: 50 for seq in seqs})
    return seqs


def test_a_draft_gets_query_slots_and_rejected_tokens_are_rolled_back():
    sched = scheduler()
    (seq,) = decoding(sched, [1, 2, 3, 4, 5, 6])  # 7 tokens, 6 computed
    seq.draft_token_ids = [7, 8, 9]
    out = sched.schedule()
    (item,) = out.sequences
    assert item.token_ids == [50, 7, 8, 9] and item.draft_token_ids == [7, 8, 9]
    assert item.start_position == 6 and len(item.block_table) == 3  # 10 slots
    assert sched.block_manager.block_hashes[item.block_table[1]] is None  # drafts: unhashed
    grew = sched.update(out, {0: 11}, {0: [7]})  # 7 accepted, then 11 instead of 8
    assert grew == [seq] and seq.output_token_ids == [50, 7, 11]
    assert seq.num_computed_tokens == 8  # 6 + the last token + the accepted draft token
    out = sched.schedule()
    assert out.sequences[0].token_ids == [11] and out.sequences[0].start_position == 8


def test_a_draft_is_cut_to_the_budget_and_the_free_blocks_never_preempting():
    sched = scheduler(num_blocks=4, block_size=4, budget=16)  # 3 usable blocks
    # 8 tokens in 2 blocks, and 2 tokens in the last free block
    seq, other = decoding(sched, [1, 2, 3, 4, 5, 6, 7], [9])
    seq.draft_token_ids = [1, 2, 3, 4, 5]
    out = sched.schedule()
    drafted = next(s for s in out.sequences if s.seq_id == 0)
    assert drafted.draft_token_ids == []  # no block left for any draft token
    assert not out.preempted_seq_ids and other.status.value == "running"
    sched.update(out, {0: 1, 1: 2})
    sched.finish(other, "stop")
    seq.draft_token_ids = [1, 2, 3, 4, 5]
    sched.max_num_batched_tokens = 3
    out = sched.schedule()
    assert out.sequences[0].draft_token_ids == [1, 2]  # the budget of 3 tokens


def test_a_steps_drafts_are_charged_to_its_token_budget():
    """Every query row counts: the first sequence's draft spends the budget its
    neighbour would have had, and no step computes more rows than the budget."""
    sched = scheduler(num_blocks=32, block_size=4, budget=5)
    first, second = decoding(sched, [1, 2, 3], [4, 5, 6])
    first.draft_token_ids = second.draft_token_ids = [7, 8, 9]
    out = sched.schedule()
    assert [len(s.token_ids) for s in out.sequences] == [4, 1]  # 1 + 3 drafts, then 1
    assert sum(len(s.token_ids) for s in out.sequences) <= 5


# -- verification ------------------------------------------------------------------------
def logits_rows(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def greedy_request(outputs=(), **params):
    return SamplingRequest(SamplingParams(temperature=0.0, **params), None, [0], list(outputs))


def test_greedy_verification_keeps_the_agreeing_prefix_then_corrects():
    sampler = Sampler(4)
    high = lambda t: [10.0 if i == t else 0.0 for i in range(4)]  # noqa: E731
    logits = logits_rows(high(1), high(2), high(3), high(0),  # A: drafts 1 2 0
                         high(2), high(3))  # B: draft 1
    drafted = [Drafted(greedy_request(), [1, 2, 0], 0, frozenset({3})),
               Drafted(greedy_request(), [1], 4, frozenset({3}))]
    owners, out = verify(sampler, logits, drafted)
    # A: 1 == 1, 2 == 2, then 3 != 0 (3 replaces 0); B: 2 != 1
    assert list(zip(owners, out.token_ids)) == [(0, 1), (1, 2), (0, 2), (0, 3)]


def test_min_tokens_is_counted_with_the_drafts_accepted_before():
    """min_tokens=2 from no outputs: EOS (3) is banned for the first two tokens,
    then allowed; after two accepted drafts it wins position 2, where a ban
    counted from the outputs before the step would have drawn draft token 0."""
    sampler = Sampler(4)
    params = SamplingParams(temperature=0.0, min_tokens=2)
    request = SamplingRequest(params, None, [0], [], banned_token_ids=frozenset({3}))
    logits = logits_rows([0.0, 10.0, 0.0, 0.0], [0.0, 0.0, 10.0, 0.0],
                         [5.0, 0.0, 0.0, 10.0], [0.0, 10.0, 0.0, 0.0])
    owners, out = verify(sampler, logits, [Drafted(request, [1, 2, 0], 0, frozenset({3}))])
    assert out.token_ids == [1, 2, 3]


def test_verification_stops_at_a_token_that_may_end_the_sequence():
    sampler = Sampler(4)
    high = lambda t: [10.0 if i == t else 0.0 for i in range(4)]  # noqa: E731
    logits = logits_rows(high(3), high(1), high(1))
    owners, out = verify(sampler, logits, [Drafted(greedy_request(), [3, 1], 0, frozenset({3}))])
    assert out.token_ids == [3]  # EOS drafted and drawn: nothing after it matters


def test_verification_sees_earlier_accepted_tokens_in_penalties():
    sampler = Sampler(4)
    logits = logits_rows([0.0, 5.0, 4.0, 0.0], [0.0, 5.0, 4.0, 0.0])
    request = greedy_request(frequency_penalty=2.0)
    owners, out = verify(sampler, logits, [Drafted(request, [1], 0, frozenset())])
    # position 1 sees token 1 once already: 5 - 2 < 4, so 2 wins, as one by one
    assert out.token_ids == [1, 2]


def draw_counts(draft, trials, seed):
    """First emitted token and (first, second) pairs over many verifications."""
    sampler = Sampler(3, seed=seed)
    logits = logits_rows([1.0, 0.5, 0.0], [0.2, 0.0, 1.0], [0.0, 0.0, 0.0])
    firsts, pairs = Counter(), Counter()
    for _ in range(trials):
        request = SamplingRequest(SamplingParams(temperature=1.0), None, [0], [])
        owners, out = verify(sampler, logits, [Drafted(request, draft, 0, frozenset())])
        firsts[out.token_ids[0]] += 1
        if len(out.token_ids) >= 2:  # the first (drafted) token was accepted
            pairs[out.token_ids[1]] += 1
    return firsts, pairs


def test_sampled_verification_keeps_the_target_distribution():
    """Chi-square of the emitted tokens against the model's own distribution,
    at both positions. A verifier that draws afresh after a rejection (instead
    of keeping the draw that rejected the draft, the residual) emits the
    drafted token 0 with 1 - (1 - p)^2 = 0.76 instead of p = 0.51 and fails."""
    trials = 4000
    firsts, pairs = draw_counts([0, 2], trials, seed=1)
    p0 = torch.tensor([1.0, 0.5, 0.0]).softmax(0)
    p1 = torch.tensor([0.2, 0.0, 1.0]).softmax(0)
    assert chi_square(firsts, p0, trials) < 13.8  # 2 degrees of freedom, p = 0.001
    accepted = firsts[0]
    assert chi_square(pairs, p1, accepted) < 13.8


def chi_square(counts: Counter, probs: torch.Tensor, total: int) -> float:
    return sum((counts[i] - total * p) ** 2 / (total * p) for i, p in enumerate(probs.tolist()))


def test_a_seeded_request_draws_the_same_tokens_with_and_without_a_draft():
    sampler = Sampler(5)
    logits = torch.randn(4, 5, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=7)
    plain, generator = [], torch.Generator().manual_seed(7)
    for row in range(4):  # one token per step, the sampled token fed back as the draft
        request = SamplingRequest(params, generator, [0], list(plain))
        plain += sampler(logits[row:row + 1], [request]).token_ids
    generator = torch.Generator().manual_seed(7)
    request = SamplingRequest(params, generator, [0], [])
    owners, out = verify(sampler, logits, [Drafted(request, plain[:3], 0, frozenset())])
    assert out.token_ids == plain
