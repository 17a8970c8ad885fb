"""/score and /rerank: how relevant each second text is to its first.

    a classifier (cross-encoder)   each pair as one sequence (the tokenizer's own pair
                                   encoding, inputs.py pair_input), scored by its head
                                   (PoolingParams(task="score"))
    an embedding model             each text embedded once, the score the cosine
                                   similarity of the two embeddings (as vLLM does)

/score pairs as vLLM does: text_1 a string (or one text) against every text_2 (1:N),
or text_1[i] against text_2[i] (N:N). /rerank is 1:N, its results sorted by score,
best first, cut to top_n.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

from starlette.requests import Request

from engine.model.pooling.scores import cosine
from service.errors import bad_request
from service.protocol.pooling import (
    PoolingUsage, RerankDocument, RerankRequest, RerankResponse, RerankResult, ScoreData,
    ScoreRequest, ScoreResponse,
)
from service.serving.pooled import run, usage
from service.serving.pooling import (
    check_count, check_request, embed_items, pair_items, pooling_params, truncation,
)
from service.serving.state import ServiceState


@dataclass(frozen=True)
class Scored:
    request_id: str
    scores: list[float]  # one per pair, in the pairs' order
    usage: PoolingUsage


def pairs_of(text_1, text_2) -> tuple[list[str], list[str], list[tuple[int, int]]]:
    """The two lists of texts, and which of each every pair takes (1:N or N:N)."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(firsts) == 1:
        return firsts, seconds, [(0, j) for j in range(len(seconds))]
    if len(firsts) != len(seconds):
        raise bad_request(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: send one "
                          f"text_1 (scored against every text_2) or as many as text_2 "
                          f"(scored pairwise)", param="text_2")
    return firsts, seconds, [(i, i) for i in range(len(firsts))]


async def score_pairs(request: Request, state: ServiceState, info, body, firsts: list[str],
                      seconds: list[str], pairs: list[tuple[int, int]], *,
                      names: tuple[str, str], id_prefix: str) -> Scored | None:
    """Each pair's score; None if the client left. `names`: the request's fields of
    the first and second texts (an input refused is named by its field)."""
    check_request(state, request, body)
    check_count(state, len(pairs), names[1])
    truncate = truncation(info, body.truncate_prompt_tokens)
    if info.task == "classify":
        # A classifier of several labels has no one score: the model is at fault.
        params = pooling_params(state, {"task": "model"}, task="score",
                                use_activation=body.use_activation)
        prepare = partial(pair_items, state, info, [(firsts[i], seconds[j]) for i, j in pairs],
                          truncate=truncate, param=names[1])
        request_id, outputs = await run(request, state, body, prepare, params,
                                        id_prefix=id_prefix, param=names[1])
        if outputs is None:
            return None
        return Scored(request_id, [float(o.outputs.data[0]) for o in outputs], usage(outputs))
    if body.use_activation is not None:
        raise bad_request("use_activation applies to a classifier's scores; this model embeds "
                          "(its scores are cosine similarities)", param="use_activation")
    return await _cosine(request, state, info, body, firsts, seconds, pairs, truncate, names,
                         id_prefix)


async def _cosine(request, state, info, body, firsts, seconds, pairs, truncate, names,
                  id_prefix) -> Scored | None:
    """Scores of an embedding model: each text embedded once, then cosine similarities."""
    params = pooling_params(state, task="embed")

    def prepare():
        return (embed_items(state, info, firsts, truncate=truncate, prompt_name=None,
                            param=names[0])
                + embed_items(state, info, seconds, truncate=truncate, prompt_name=None,
                              param=names[1]))

    request_id, outputs = await run(request, state, body, prepare, params, id_prefix=id_prefix,
                                    param=names[1])
    if outputs is None:
        return None
    vectors = [o.outputs.data for o in outputs]
    left, right = vectors[:len(firsts)], vectors[len(firsts):]
    scores = [cosine(left[i], right[j]) for i, j in pairs]
    return Scored(request_id, scores, usage(outputs))


async def score(request: Request, state: ServiceState, info,
                body: ScoreRequest) -> ScoreResponse | None:
    """POST /score: a score per pair, in the pairs' order."""
    firsts, seconds, pairs = pairs_of(body.text_1, body.text_2)
    scored = await score_pairs(request, state, info, body, firsts, seconds, pairs,
                               names=("text_1", "text_2"), id_prefix="score")
    if scored is None:
        return None
    data = [ScoreData(i, s) for i, s in enumerate(scored.scores)]
    return ScoreResponse(scored.request_id, int(time.time()), state.model_name, data,
                         scored.usage)


async def rerank(request: Request, state: ServiceState, info,
                 body: RerankRequest) -> RerankResponse | None:
    """POST /rerank (and /v1/rerank, /v2/rerank): the documents by relevance to the
    query, best first, the first top_n of them."""
    documents = body.documents
    scored = await score_pairs(request, state, info, body, [body.query], documents,
                               [(0, j) for j in range(len(documents))],
                               names=("query", "documents"), id_prefix="rerank")
    if scored is None:
        return None
    order = sorted(range(len(documents)), key=lambda j: scored.scores[j], reverse=True)
    if body.top_n:
        order = order[:body.top_n]
    results = [RerankResult(j, scored.scores[j],
                            RerankDocument(documents[j]) if body.return_documents else None)
               for j in order]
    return RerankResponse(scored.request_id, state.model_name, scored.usage, results)
