"""HF's greedy outputs and the comparison rule the parity tests (and the GPU
acceptance run, bench/gpu/gpu_check.py) judge the engine by."""

from __future__ import annotations

from pathlib import Path

import torch

TOP_K = 5


def hf_greedy(folder: Path, prompts, num_tokens: int, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(device)
    model.generation_config.eos_token_id = None
    results = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            do_sample=False, max_new_tokens=num_tokens, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0,
        )
        tops = [_top_k(torch.log_softmax(lg[0].float(), -1)) for lg in out.logits]
        results.append((out.sequences[0, len(prompt):].tolist(), tops))
    return results


def _top_k(logprobs: torch.Tensor) -> dict[int, float]:
    values, indices = logprobs.topk(TOP_K)
    return dict(zip(indices.tolist(), values.tolist()))


def compare(expected, actual) -> dict:
    """Counts under the check_logprobs_close rule; `ok` is False on a real divergence."""
    exact, near_ties, failures = 0, 0, []
    for i, ((ref_ids, ref_tops), (ids, tops)) in enumerate(zip(expected, actual)):
        mismatch = next((p for p, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), None)
        if mismatch is None and len(ref_ids) == len(ids):
            exact += 1
        elif mismatch is not None and ids[mismatch] in ref_tops[mismatch] \
                and ref_ids[mismatch] in tops[mismatch]:
            near_ties += 1
        else:
            failures.append({"prompt": i, "position": mismatch})
    return {"exact": exact, "near_ties": near_ties, "failures": failures, "ok": not failures}
