"""Suffix decoding (Arctic's): continuations counted over everything seen.

An n-gram lookup remembers only the latest occurrence of one suffix. Suffix
decoding keeps counts: a trie of every run of up to D tokens (D =
suffix_decoding_max_tree_depth) with how often each continued each way,

    request tokens  a b c a b d a b       trie (counts)   a:3 ─ b:3 ─┬ c:1
                                                                  └ d:1
    context ends "a b": the deepest node matching the context's suffix is a→b;
    its children say c or d, each 1 of 2; a draft follows the likeliest child
    while the product of those shares stays >= suffix_decoding_min_token_prob,
    for at most max_spec_factor x (length of the match) tokens.

Two tries are consulted: the request's own (prompt and output so far, the
same text an n-gram looks in) and a global one over the outputs of the last
`suffix_decoding_max_cached_requests` finished requests, which catches what
agents and templated answers repeat across requests. The deeper match wins;
at equal depth the request's own does.

Each trie is extended a token at a time: the nodes of the context's current
suffixes of length 0..D-1 ("active" nodes) each gain the new token as a
child, so appending costs D dict operations, whatever the text's length.
A node is `[count, children]`; the global trie's counts drop (and empty
nodes go) when a request leaves the cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def _node() -> list:
    return [0, {}]


@dataclass
class SuffixHandle:
    """One request's place: its own trie and where the context sits in both tries."""

    root: list = field(default_factory=_node)
    active: list = field(default_factory=list)  # local nodes of the current suffixes
    global_active: list = field(default_factory=list)  # the same in the global trie
    prompt_length: int = 0
    history: list[int] = field(default_factory=list)


class SuffixCache:
    def __init__(self, config) -> None:
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_requests = config.suffix_decoding_max_cached_requests
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.global_root = _node()
        self.cached: deque[list[int]] = deque()  # outputs in the global trie, oldest first

    # -- a request's own trie ----------------------------------------------------------
    def start(self, request_id: str, prompt: list[int]) -> SuffixHandle:
        handle = SuffixHandle(prompt_length=len(prompt))
        self.extend(handle, prompt, len(prompt))
        return handle

    def extend(self, handle: SuffixHandle, tokens: list[int], count: int) -> None:
        """Add the last `count` of `tokens` (the request's whole text) to its trie."""
        handle.history = tokens
        for token in tokens[len(tokens) - count:]:
            handle.active = _advance(handle.root, handle.active, token, self.depth, insert=True)
            handle.global_active = _advance(self.global_root, handle.global_active, token,
                                            self.depth, insert=False)

    def finish(self, handle: SuffixHandle) -> None:
        """The request ended: its output joins the global trie (oldest leave first)."""
        if self.max_requests == 0:
            return
        output = handle.history[handle.prompt_length:]
        _add_runs(self.global_root, output, self.depth, +1)
        self.cached.append(output)
        while len(self.cached) > self.max_requests:
            _add_runs(self.global_root, self.cached.popleft(), self.depth, -1)

    # -- drafting ------------------------------------------------------------------------
    def propose(self, handle: SuffixHandle, k: int) -> list[int]:
        """Up to k tokens along the likeliest continuation of the deepest match."""
        best_depth, best = _deepest(handle.active)
        global_depth, global_best = _deepest(handle.global_active)
        if global_depth > best_depth:
            best_depth, best = global_depth, global_best
        if best is None:
            return []
        limit = min(k, max(1, int(self.spec_factor * best_depth)))
        draft, node, probability = [], best, 1.0
        while len(draft) < limit and node[1]:
            token, child = max(node[1].items(), key=lambda item: item[1][0])
            probability *= child[0] / sum(c[0] for c in node[1].values())
            if probability < self.min_prob:
                break
            draft.append(token)
            node = child
        return draft


def _advance(root: list, active: list, token: int, depth: int, insert: bool) -> list:
    """The nodes of the suffixes after `token` is appended: each active node's
    child `token` (created and counted when inserting), plus root's."""
    advanced = []
    for node in [root, *active[: depth - 1]]:
        child = node[1].get(token)
        if child is None:
            if not insert:
                continue
            child = node[1][token] = _node()
        if insert:
            child[0] += 1
        advanced.append(child)
    return advanced


def _deepest(active: list) -> tuple[int, list | None]:
    """The deepest active node that has seen a continuation, with its depth.

    Active nodes are ordered by depth, shortest first; the deepest one of a
    request's own trie is the context itself and has no child until the
    same run occurred before."""
    for depth in range(len(active), 0, -1):
        node = active[depth - 1]
        if node[1]:
            return depth, node
    return 0, None


def _add_runs(root: list, tokens: list[int], depth: int, sign: int) -> None:
    """Count (+1) or uncount (-1) every run of up to `depth` tokens of `tokens`;
    a node whose count falls to 0 goes, with everything under it."""
    for start in range(len(tokens)):
        node = root
        for token in tokens[start:start + depth]:
            child = node[1].get(token)
            if child is None:
                if sign < 0:
                    break  # already gone with an emptied parent
                child = node[1][token] = _node()
            child[0] += sign
            if child[0] <= 0:
                del node[1][token]
                break
            node = child
