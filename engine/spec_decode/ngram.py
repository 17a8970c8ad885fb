"""N-gram drafts ("prompt lookup"): text that repeats its input drafts itself.

Rewrites, quotes, code edits and RAG answers copy long spans of their prompt.
When the last n tokens of the context occurred before, the tokens that
followed that occurrence are a good guess for what comes next:

    context:  ... the quick brown fox jumps over ... | the quick brown
                      ^^^^^^^^^^^^^^^ earlier match     ^^^^^^^^^^^^^^^ last n tokens
    draft:    fox jumps over ...   (the k tokens after the match)

n goes from `max_n` down to `min_n`; the longest n that matches wins, and
among its occurrences the latest (a recent repeat predicts better than one
from the start of a long prompt). A latest match near the end drafts on
through its own draft: in "x y x y", the match of "y" at position 1 drafts
"x y x y ...".

Each sequence keeps an index, n-gram -> the position just after its latest
occurrence, extended by the tokens that arrived since the last call: a
proposal costs (max_n - min_n + 1) dict updates per new token and one lookup
per n, however long the context is.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the
        longest matching suffix of `tokens` ([] when none matches)."""
        length = len(tokens)
        self._index(tokens, length - 1)  # every n-gram but the suffix itself
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.ends.get(tuple(tokens[length - n:]))
            if end is not None:
                return _copy(tokens, end, k)
        return []

    def _index(self, tokens: Sequence[int], upto: int) -> None:
        """Record the n-grams that end at positions (self.indexed, upto]."""
        for end in range(max(self.indexed, self.min_n), upto + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, upto + 1)


def _copy(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """k tokens from `start` on, where the text past its end reads on into the
    draft itself (an overlapping copy, as LZ77's): a latest match close to the
    end still drafts k tokens of a repeating pattern ("1 2 1 2 ..." -> "1 2 1 2")."""
    length = len(tokens)
    draft: list[int] = []
    for position in range(start, start + k):
        draft.append(tokens[position] if position < length else draft[position - length])
    return draft
