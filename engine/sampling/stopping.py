"""Stopping: the one place that decides when a sequence ends, and what text it keeps.

After each new token of a sequence, the first rule that applies ends it:

    rule             finish_reason  stop_reason   the token's text in the output
    stop token id    "stop"         the id        only with include_stop_str_in_output
    EOS              "stop"         None          never (unless ignore_eos: not a stop)
    stop string      "stop"         the string    text cut before it (after it with
                                                  include_stop_str_in_output)
    constraint done  "stop"         None          kept (its end: EOS, not shown)
    max_tokens       "length"       None          kept
    max_model_len    "length"       None          kept

So within one token a stop id beats EOS, EOS beats a stop string, and any
stop beats length (a stop string completed by the last allowed token is a
"stop"). These are vLLM's semantics. A structured-output constraint
(engine/sampling/structured_outputs.py) sees every token first; once it is complete
it only allows EOS, so it normally ends as EOS does, and with ignore_eos its
end stops the sequence all the same. `max_tokens` can cut a constrained
output short: that is "length", and the text is then not guaranteed to match.

min_tokens holds back the first three rules, in two halves that share one
test, `may_stop`:
- before sampling, a sequence that may not stop yet must not draw a token
  that would stop it: `banned_token_ids` lists them (stop ids, and EOS unless
  ignore_eos) and the sampler only applies that mask;
- after sampling, a token that still would (a stop string needs no special
  token) is not a stop until the sequence may stop.
So EOS and stop ids can come at output token min_tokens + 1 at the earliest,
and a stop string can complete with output token min_tokens.

Stop strings are matched in the text the detokenizer commits, across token
boundaries; while streaming, text that may be the start of a stop string is
held back, so a stop string never reaches a client. Text the detokenizer still
holds when a sequence ends for another reason (a SentencePiece byte-fallback
run, committed only once a later token ends it) is committed then and matched
too: a stop string in it makes the stop a stop-string stop, as it would have
been had the text come earlier.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from engine.sampling.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

_NO_TOKENS: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Stop:
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop token id or stop string


def may_stop(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a sequence with this many output tokens may stop on a stop
    token, EOS or stop string: the only place min_tokens is read."""
    return num_output_tokens >= params.min_tokens


def banned_token_ids(
    params: SamplingParams, num_output_tokens: int, eos_token_ids: Collection[int]
) -> frozenset[int]:
    """Token ids the next token of a sequence with `num_output_tokens` outputs
    may not be: while it may not stop, every token that would stop it."""
    if may_stop(params, num_output_tokens):
        return _NO_TOKENS
    banned = set(params.stop_token_ids)
    # With ignore_eos, EOS does not end the sequence, so it need not be banned
    # (as in vLLM).
    if not params.ignore_eos:
        banned.update(eos_token_ids)
    return frozenset(banned)


class StopStringMatcher:
    """Finds stop strings in text that arrives one committed piece at a time.

    It keeps only the last max(len(stop)) - 1 characters: a new match must end
    inside the newest piece, so it lies within that tail plus the piece, which
    also covers a stop string spread over several tokens.
    """

    def __init__(self, stops: list[str], include_in_output: bool) -> None:
        self._stops = stops
        self._include = include_in_output
        self._tail_size = max((len(stop) for stop in stops), default=1) - 1
        self._tail = ""

    def feed(self, piece: str, may_match: bool) -> tuple[str, int] | None:
        """Add a piece of text; return (stop string, characters to cut from the
        end of the text) for a stop string that ends in it, if matching is
        allowed. The earliest match wins, as that is what a reader sees first;
        of two starting at the same place (one a prefix of the other) the
        shorter wins, since it is complete first."""
        previous = self._tail
        window = previous + piece
        self._tail = window[-self._tail_size :] if self._tail_size else ""
        if not (piece and may_match and self._stops):
            return None
        best: tuple[int, str] | None = None
        for stop in self._stops:
            position = window.find(stop, max(0, len(previous) - len(stop) + 1))
            if position != -1 and (best is None or (position, len(stop)) < (best[0], len(best[1]))):
                best = (position, stop)
        if best is None:
            return None
        position, stop = best
        keep = position + len(stop) if self._include else position
        return stop, len(window) - keep

    def held_back_length(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix
        of some stop string (0 when there are no stop strings)."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self._tail)), longest, -1):
                if self._tail.endswith(stop[:length]):
                    longest = length
                    break
        return longest


class StopChecker:
    """Decides, token by token, whether one sequence ends, and feeds its
    detokenizer the tokens that become text."""

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: Collection[int],
        max_model_len: int,
        num_prompt_tokens: int,
        detokenizer: IncrementalDetokenizer,
        grammar=None,
    ) -> None:
        """`grammar`: the sequence's structured-output matcher, if constrained."""
        self._params = params
        self._eos_token_ids = eos_token_ids
        self._max_model_len = max_model_len
        self._num_prompt_tokens = num_prompt_tokens
        self._detokenizer = detokenizer
        self._grammar = grammar
        self._stop_strings = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.stop: Stop | None = None  # set once the sequence has stopped

    def check(self, token_id: int, num_output_tokens: int) -> Stop | None:
        """The newest token, output number `num_output_tokens`: does it end the
        sequence? Tokens after a stop are ignored (a finished sequence takes
        none)."""
        if self.stop is None:
            stop = self._check(token_id, num_output_tokens)
            if stop is not None and not isinstance(stop.stop_reason, str):
                stop = self._check_flushed_text(stop, num_output_tokens)
            self.stop = stop
            return stop
        return None

    def _check_flushed_text(self, stop: Stop, num_output_tokens: int) -> Stop:
        """The sequence ends: text the detokenizer still held (a SentencePiece
        byte-fallback run that no token closed, see detokenizer.py) is final
        now, and a stop string in it still cuts the output, as it would have
        had its text come earlier."""
        piece = self._detokenizer.flush()
        match = self._stop_strings.feed(piece, may_stop(self._params, num_output_tokens))
        if match is None:
            return stop
        stop_string, cut = match
        self._detokenizer.trim(cut)
        return Stop("stop", stop_string)

    def held_back_length(self) -> int:
        """How many trailing characters a stream must not show yet: they may
        be the start of a stop string. Nothing once stopped."""
        return 0 if self.stop is not None else self._stop_strings.held_back_length()

    def _check(self, token_id: int, num_output_tokens: int) -> Stop | None:
        params = self._params
        if self._grammar is not None:
            self._grammar.accept(token_id)
        stoppable = may_stop(params, num_output_tokens)
        if stoppable and token_id in params.stop_token_ids:
            if params.include_stop_str_in_output:
                self._append_text(token_id, stoppable)
            return Stop("stop", token_id)
        if stoppable and not params.ignore_eos and token_id in self._eos_token_ids:
            return Stop("stop")
        stop_string = self._append_text(token_id, stoppable)
        if stop_string is not None:
            return Stop("stop", stop_string)
        if self._grammar is not None and self._grammar.is_terminated:
            return Stop("stop")
        num_tokens = self._num_prompt_tokens + num_output_tokens
        if num_output_tokens >= params.max_tokens or num_tokens >= self._max_model_len:
            return Stop("length")
        return None

    def _append_text(self, token_id: int, stoppable: bool) -> str | None:
        """Detokenize the token; cut the text at a stop string it completes
        and return that string."""
        piece = self._detokenizer.update([token_id])
        match = self._stop_strings.feed(piece, stoppable)
        if match is None:
            return None
        stop, cut = match
        self._detokenizer.trim(cut)
        return stop
