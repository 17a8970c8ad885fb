"""Speculative decoding without a draft model: proposers and their bookkeeping.

    speculator.py  which sequences draft this step and how many tokens (adaptive),
                   the counters /metrics shows
    ngram.py       prompt lookup: the tokens after the latest earlier occurrence
                   of the context's last n tokens
    suffix.py      suffix decoding: continuations counted over the request and
                   recent requests' outputs

A proposer sees token lists only. The scheduler gives the drafts query slots
(engine/core/scheduler.py), the runner verifies them in the same forward pass
(engine/sampling/speculative.py).
"""
