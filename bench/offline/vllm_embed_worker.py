"""vLLM's offline pooling as a third system of the embeddings benchmark, in vLLM's interpreter.

    VENV/bin/python bench/offline/vllm_embed_worker.py JOB.json

JOB.json: {"folder", "dtype", "texts", "query", "vectors", "enforce_eager"}
(enforce_eager false: vLLM's default, torch.compile of the model at start).
This script imports nothing of pagedserve (vLLM's virtualenv does not have it).
It loads the model, embeds every text twice (the warm-up; the first call's vectors
go to the "vectors" path, .npy, for the parent to compare) and the query three times,
answers {"version", "ready"}, then times what each stdin line asks: "texts" (one
`embed` call with every text) or "query" (the query alone), and answers
{"seconds"} with its own clock; "quit" ends it. Answers are one JSON object on a
stdout line after MARKER (vLLM logs to stdout too), so the parent can run this
system in turn with its own two, round by round.
"""

from __future__ import annotations

import json
import sys
import time

MARKER = "EMBEDDINGS-RESULT "


def reply(answer: dict) -> None:
    print(MARKER + json.dumps(answer), flush=True)


def main(job_file: str) -> int:
    with open(job_file) as f:
        job = json.load(f)
    import numpy as np
    import vllm
    from vllm import LLM

    llm = LLM(model=job["folder"], runner="pooling", dtype=job["dtype"],
              enforce_eager=job["enforce_eager"], seed=0)
    texts, query = job["texts"], [job["query"]]
    outputs = llm.embed(texts, use_tqdm=False)
    np.save(job["vectors"], np.array([o.outputs.embedding for o in outputs], dtype=np.float32))
    llm.embed(texts, use_tqdm=False)  # a second warm-up, as the parent gives its own systems
    for _ in range(3):
        llm.embed(query, use_tqdm=False)
    reply({"version": vllm.__version__, "ready": True})
    for line in sys.stdin:
        what = line.strip()
        if what == "quit":
            break
        batch = texts if what == "texts" else query
        start = time.perf_counter()
        llm.embed(batch, use_tqdm=False)
        reply({"seconds": time.perf_counter() - start})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
