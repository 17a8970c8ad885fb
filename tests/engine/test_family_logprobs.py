"""The families whose options a greedy comparison can miss, held to HF's numbers.

A tiny random model's next-token distribution is flat, so the greedy family
tests (test_model_families.py) allow near-ties, and an option read from the
wrong field can pass them: Gemma's score scale from head_dim instead of
query_pre_attn_scalar, Gemma 2's two soft caps swapped. Here the first
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


def hf_top(folder, prompt: list[int]) -> dict[int, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    values, ids = torch.log_softmax(logits.float(), -1).topk(TOP)
    return dict(zip(ids.tolist(), values.tolist()))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_first_token_logprobs_are_hfs(family, tmp_path, smollm2_path, single_thread):
    folder = make_tiny_family(tmp_path / family, family, smollm2_path)
    llm = LLM(str(folder), dtype="float32", block_size=16)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=TOP)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        ours = dict(output.outputs[0].top_logprobs[0])
        theirs = hf_top(folder, prompt)
        assert set(ours) == set(theirs), (ours, theirs)
        for token, value in theirs.items():
            assert abs(ours[token] - value) < 1e-4, (family, token, ours[token], value)
