"""The families whose options a greedy comparison can miss, held to HF's numbers.

A tiny random model's next-token distribution is flat, so the greedy family
tests (test_model_families.py) allow near-ties, and an option read from the
wrong field can pass them: Gemma's score scale from head_dim instead of
query_pre_attn_scalar, Gemma 2's two soft caps swapped, Qwen3-MoE's
norm_topk_prob taken as always on (the tiny family sets it). Here the first
token's log-probabilities after a prompt are compared with HF's own in
float32, where such a slip moves them by far more than the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tiny_models import make_tiny_family

TOP = 5
PROMPTS = [list(range(100, 160)), list(range(300, 307))]


def hf_tops(folder, prompts: list[list[int]]) -> list[dict[int, float]]:
    """HF's top log-probabilities for the token after each prompt, in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tops = []
    for prompt in prompts:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, -1]
        values, ids = torch.log_softmax(logits.float(), -1).topk(TOP)
        tops.append(dict(zip(ids.tolist(), values.tolist())))
    return tops


@pytest.mark.parametrize("family,options", [
    ("gemma2", {}), ("gemma3", {}),
    ("qwen3-moe", {"norm_topk_prob": True}), ("qwen3-moe", {"norm_topk_prob": False})],
    ids=["gemma2", "gemma3", "qwen3-moe-normed", "qwen3-moe-unnormed"])
def test_first_token_logprobs_are_hfs(family, options, tmp_path, smollm2_path, single_thread):
    folder = make_tiny_family(tmp_path / family, family, smollm2_path, **options)
    llm = LLM(str(folder), dtype="float32", block_size=16)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=TOP)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for output, theirs in zip(outputs, hf_tops(folder, PROMPTS)):
        ours = dict(output.outputs[0].top_logprobs[0])
        assert set(ours) == set(theirs), (ours, theirs)
        for token, value in theirs.items():
            assert abs(ours[token] - value) < 1e-4, (family, token, ours[token], value)
