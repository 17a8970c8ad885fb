"""From logits to tokens to text.

    sampler.py             penalties, temperature, top-k/p/min-p, logprobs, grammar masks
    stopping.py            the one place that decides EOS / stop strings / length / min_tokens
    detokenizer.py         incremental detokenization, exact for byte-level and SentencePiece
    structured_outputs.py  JSON schema / regex / grammar / choice through xgrammar
"""
