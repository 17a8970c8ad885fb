"""Tensor parallelism over the other families (gloo on CPU, real workers):
Qwen3 (per-head q/k norm), Gemma 2 (four norms, soft caps, sliding layers)
and Mistral (a window on every layer, blocks released behind it) split over
two ranks give the unsplit model's greedy tokens in float32; families whose
checkpoints cannot be sliced yet are refused before any worker starts."""

from __future__ import annotations

import pytest

from test_tensor_parallel import greedy_run
from tiny_models import make_tiny_family


@pytest.fixture(scope="module", params=["qwen3", "gemma2", "mistral-sliding"])
def family_path(request, tmp_path_factory, smollm2_path):
    return make_tiny_family(tmp_path_factory.mktemp(request.param), request.param, smollm2_path)


def test_two_ranks_match_one(family_path):
    one, *_ = greedy_run(family_path, 1)
    two, *_ = greedy_run(family_path, 2)
    assert two == one


@pytest.mark.parametrize("family, reason", [("phi3", "Phi3ForCausalLM"),
                                            ("mixtral", "MixtralForCausalLM")])
def test_unsliceable_families_are_refused_up_front(family, reason, tmp_path, smollm2_path):
    from engine import LLM

    path = make_tiny_family(tmp_path / family, family, smollm2_path)
    with pytest.raises(ValueError, match=f"{reason}: tensor parallelism is not supported"):
        LLM(str(path), dtype="float32", tensor_parallel_size=2)
