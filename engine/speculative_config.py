"""SpeculativeConfig: vLLM's `speculative_config` for the proposers that need
no draft model, parsed and validated once (EngineConfig holds one)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

SPECULATIVE_METHODS = ("ngram", "suffix")  # proposers that need no draft model
# Drafted tokens a step may verify per sequence. Why a bound: each position
# is a row of every step and a series in /metrics (100,000 made every scrape
# 7.9 MB), and past a few dozen a draft is almost never accepted whole.
MAX_DRAFT_TOKENS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for the methods that need no draft model
    (engine/spec_decode/): the same keys, the same meaning.

    ngram   draft the tokens that followed the latest earlier occurrence of the
            context's last n tokens, n from prompt_lookup_max down to
            prompt_lookup_min (both 5 when neither is given, as in vLLM)
    suffix  Arctic's suffix decoding: continuations counted over the request's
            own tokens and the outputs of recent requests, drafted while their
            estimated probability stays above suffix_decoding_min_token_prob

    disable_by_batch_size: no drafts in a step with more running sequences than
    this. vLLM's default is never; ours is 8, because on a CPU a batch of that
    size already spends its step computing, and drafts would only add work.
    """

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = 8
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method={self.method!r} is not supported: "
                             f"choose one of {SPECULATIVE_METHODS} (draft models are not served)")
        if self.method == "ngram":
            self._fill_lookup()
        elif self.num_speculative_tokens is None:  # vLLM: the tree depth for suffix
            object.__setattr__(self, "num_speculative_tokens",
                               self.suffix_decoding_max_tree_depth)
        for name, minimum, maximum in (
                ("num_speculative_tokens", 1, MAX_DRAFT_TOKENS), ("prompt_lookup_min", 1, None),
                ("prompt_lookup_max", 1, None), ("disable_by_batch_size", 1, None),
                ("suffix_decoding_max_tree_depth", 1, MAX_DRAFT_TOKENS),
                ("suffix_decoding_max_cached_requests", 0, None)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < minimum or (maximum and value > maximum)):
                raise ValueError(f"speculative_config.{name}={value!r} must be an integer "
                                 f">= {minimum}" + (f" and <= {maximum}" if maximum else ""))
        for name, low, high in (("suffix_decoding_max_spec_factor", 0.0, None),
                                ("suffix_decoding_min_token_prob", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not value >= low or (high is not None and value > high):
                raise ValueError(f"speculative_config.{name}={value!r} must be a number "
                                 f">= {low}" + (f" and <= {high}" if high is not None else ""))

    def _fill_lookup(self) -> None:
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config.num_speculative_tokens is required for "
                             "method 'ngram'")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low, high = (high if low is None else low), (low if high is None else high)
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        if isinstance(low, int) and isinstance(high, int) and low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min={low} must be <= "
                             f"prompt_lookup_max={high}")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig":
        """From the flag's JSON text, a dict (the Python API's) or a SpeculativeConfig."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]} is not a supported key "
                             f"(supported: {', '.join(sorted(known))})")
        return cls(**value)
