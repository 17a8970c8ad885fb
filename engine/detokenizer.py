"""Incremental detokenization and stop-string detection for one sequence.

Decoding token by token does not work on its own: byte-level BPE splits
multi-byte characters over several tokens, and some tokenizers render a token
differently depending on its neighbours (SentencePiece drops the leading
space of the first token of a decode). So, like vLLM, each step decodes a
small window twice -- the tokens already turned into text (the "prefix") and
the same tokens plus the new ones -- and emits the difference. The new text is
only committed when it does not end in U+FFFD, i.e. when the last character
is complete; otherwise the tokens stay pending and the window grows.

Each step therefore decodes a handful of tokens, not the whole output.

Contract with the engine:
- output_text equals tokenizer.decode(output_ids, skip_special_tokens=...,
  clean_up_tokenization_spaces=False), cut at a stop string. The window is
  seeded with the prompt's last tokens, so with SentencePiece tokenizers a
  leading space of the first output token is kept (as vLLM does) where a bare
  decode of the output would drop it.
- Stop strings are only looked for once min_tokens tokens were fed, and only
  in text produced from then on (plus its overlap with earlier text).
- The detokenizer does not know EOS or stop_token_ids: whichever tokens the
  engine feeds become text (special ones vanish under skip_special_tokens).
"""

from __future__ import annotations

from typing import Any

from engine.sampling_params import SamplingParams

# How many prompt tokens seed the window. They give the first output token
# its real left context (e.g. a SentencePiece leading space is kept), and a
# few are enough since only the last complete character matters.
PROMPT_CONTEXT_TOKENS = 5

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self._tokenizer = tokenizer
        self._params = params
        self._stop = list(params.stop) if tokenizer is not None else []
        # The committed text is kept as one piece per step rather than one
        # growing str: appending to a str attribute copies it every time,
        # which is quadratic over a long generation.
        self._pieces: list[str] = []
        self._length = 0
        self._joined = ""  # cache of "".join(self._pieces)
        self._joined_pieces = 0
        # The last max(len(stop)) - 1 committed characters: all that stop
        # matching across steps and stream hold-back ever need to look at.
        self._tail = ""
        self._tail_size = max((len(stop) for stop in self._stop), default=1) - 1
        self._sent = 0  # characters already handed out by get_delta
        self._num_output_tokens = 0
        self._stopped = False
        self._ids = self._initial_context(list(prompt_token_ids))
        # _ids[prefix_offset:read_offset] is the last committed chunk, kept
        # as left context; _ids[read_offset:] is not yet text.
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    @property
    def output_text(self) -> str:
        """All text so far. When generation ended on an incomplete character,
        the pending bytes are included as U+FFFD, exactly as a full decode
        would render them."""
        return self._committed_text() + self._pending_text()

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; later updates are ignored."""
        return self._stopped

    @property
    def num_output_tokens(self) -> int:
        """Output tokens consumed. After a stop-string match this counts the
        tokens up to and including the one that completed the stop string."""
        return self._num_output_tokens

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string they completed, if any.

        Tokens after the one that completes a stop string are not consumed.
        """
        if self._stopped:
            return None
        for token_id in new_token_ids:
            self._num_output_tokens += 1
            if self._tokenizer is None:
                continue
            self._ids.append(token_id)
            previous_tail = self._tail
            piece = self._commit_complete_text()
            stop = self._check_stop(previous_tail, piece) if (piece and self._stop) else None
            if stop is not None:
                return stop
        return None

    def get_delta(self, finished: bool) -> str:
        """Text not returned by earlier calls.

        While unfinished, a trailing piece that could be the start of a stop
        string is held back, so a stop string never reaches a stream, and so
        are incomplete characters. finished=True flushes everything, so the
        deltas always add up to output_text.
        """
        if finished:
            self._flush_pending()
        end = self._length
        if not (finished or self._stopped):
            end -= self._held_back_length()
        if end <= self._sent:
            return ""
        delta = self._text_since(self._sent)[: end - self._sent]
        self._sent = end
        return delta

    def _initial_context(self, prompt_token_ids: list[int]) -> list[int]:
        if self._tokenizer is None:
            return []
        context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        # A prompt cut inside a character would make the first output
        # character merge with it; decoding the output on its own is then the
        # only answer consistent with tokenizer.decode(output_ids).
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            return []
        return context

    def _decode(self, token_ids: list[int]) -> str:
        # Clean-up of tokenization spaces rewrites text across token
        # boundaries (" ." -> "."), which would make the window difference
        # wrong; vLLM does not apply it either.
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._params.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _window_texts(self) -> tuple[str, str]:
        """(text of the committed context chunk, text of the whole window)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        return prefix_text, window_text

    def _commit_complete_text(self) -> str:
        """Commit the text of pending tokens if it ends on a whole character;
        return what was committed ("" when nothing was)."""
        prefix_text, window_text = self._window_texts()
        # Strictly longer: a skipped special token adds nothing, and some
        # tokenizers render an incomplete byte sequence as nothing at all.
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        piece = window_text[len(prefix_text) :]
        self._commit(piece)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return piece

    def _flush_pending(self) -> None:
        """Commit tokens that never completed a character. Their bytes are
        rendered as U+FFFD, like a full decode does. They are not checked for
        stop strings: this only happens once generation has ended."""
        pending = self._pending_text()
        if pending:
            self._commit(pending)
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def _pending_text(self) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text, window_text = self._window_texts()
        return window_text[len(prefix_text) :]

    def _commit(self, piece: str) -> None:
        if not piece:
            return
        self._pieces.append(piece)
        self._length += len(piece)
        self._tail = (self._tail + piece)[-self._tail_size :] if self._tail_size else ""

    def _committed_text(self) -> str:
        if self._joined_pieces != len(self._pieces):
            self._joined += "".join(self._pieces[self._joined_pieces :])
            self._joined_pieces = len(self._pieces)
        return self._joined

    def _text_since(self, start: int) -> str:
        """Committed text from character `start` on, by walking pieces back
        from the end: deltas are short, so this touches only a few pieces."""
        parts = []
        position = self._length
        for piece in reversed(self._pieces):
            if position <= start:
                break
            piece_start = position - len(piece)
            parts.append(piece[max(start - piece_start, 0) :])
            position = piece_start
        return "".join(reversed(parts))

    def _check_stop(self, previous_tail: str, piece: str) -> str | None:
        """Find a stop string ending in the piece just committed.

        A new match must end inside `piece`, so it lies within the previous
        tail (the last max(len(stop)) - 1 characters) plus the piece; that also
        covers a stop string split over several tokens. The earliest match
        wins, as that is what a reader would see first.
        """
        if self._num_output_tokens < self._params.min_tokens:
            return None
        window = previous_tail + piece
        best: tuple[int, str] | None = None
        for stop in self._stop:
            position = window.find(stop, max(0, len(previous_tail) - len(stop) + 1))
            if position != -1 and (best is None or position < best[0]):
                best = (position, stop)
        if best is None:
            return None
        position, stop = best
        if self._params.include_stop_str_in_output:
            position += len(stop)
        self._truncate(self._length - len(window) + position)
        self._stopped = True
        return stop

    def _truncate(self, length: int) -> None:
        """Drop committed text past `length` characters."""
        while self._length > length:
            piece = self._pieces.pop()
            self._length -= len(piece)
            if self._length < length:
                self._pieces.append(piece[: length - self._length])
                self._length = length
        # The joined cache and the tail may hold dropped text: rebuild them.
        self._joined, self._joined_pieces = "", 0
        self._tail = self._text_since(max(0, length - self._tail_size)) if self._tail_size else ""

    def _held_back_length(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix
        of some stop string (0 when there are no stop strings)."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(self._tail)), longest, -1):
                if self._tail.endswith(stop[:length]):
                    longest = length
                    break
        return longest
