"""Every served family against HF transformers: greedy float32, token for token.

Tiny random checkpoints of each family (tests/tiny_models.py FAMILIES) are
built with transformers' own classes, loaded through the public
`LLM(model=folder)`, and run under the scheduling paths that matter for
them: block sizes 1, 16 and 128, chunked prefill, forced preemption. The
prompts run to 300 tokens, far past every 20-token sliding window, so a
layer that ignored its window would diverge at the first generated token.
The comparison rule is test_hf_parity's (a near-tie at the first divergence,
each token in the other's top-k, is allowed and nothing else).
"""

from __future__ import annotations

import pytest

from test_hf_parity import check_greedy, hf_case
from tiny_models import FAMILIES, make_tiny_family

# Families whose every layer slides: the engine releases blocks behind the
# window, so the budget that preempts the others is enough for them
# (test_sliding_window_blocks.py shows how many blocks they hold).
ALL_SLIDING = {"mistral-sliding", "phi3", "mixtral"}

CONFIGS = [
    ("block1", dict(block_size=1), False),
    ("block128", dict(block_size=128), False),
    ("block16-chunked", dict(block_size=16, max_num_batched_tokens=32), False),
    ("block16-chunked-preempt",
     dict(block_size=16, max_num_batched_tokens=48, max_model_len=400, num_gpu_blocks_override=30,
          schedule_conservativeness=0), True),
]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request, tmp_path_factory, smollm2_path, single_thread):
    folder = tmp_path_factory.mktemp(request.param)
    return hf_case(request.param, make_tiny_family(folder, request.param, smollm2_path))


@pytest.mark.parametrize("name,engine_args,preempts", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_family_greedy_matches_hf(family_case, name, engine_args, preempts):
    family, _, prompts, _ = family_case
    result = check_greedy(family_case, name, engine_args, preempts and family not in ALL_SLIDING)
    assert result["exact"] >= len(prompts) - 2, f"{family}/{name}: too many near-ties {result}"
