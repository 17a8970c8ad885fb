"""Incremental detokenization of one sequence: token ids in, text and deltas out.

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
- output_text equals tokenizer.decode(fed_ids, skip_special_tokens=...,
  clean_up_tokenization_spaces=False), minus what `trim` removed. The window
  is seeded with the prompt's last tokens, so with SentencePiece tokenizers a
  leading space of the first output token is kept (as vLLM does) where a bare
  decode of the output would drop it.
- The detokenizer knows nothing about stopping: which tokens become text, where
  a stop string cuts it and how much of a stream is held back are decided in
  engine/sampling/stopping.py, which feeds it and tells it.
"""

from __future__ import annotations

from typing import Any

# How many prompt tokens seed the window. They give the first output token
# its real left context (e.g. a SentencePiece leading space is kept), and a
# few are enough since only the last complete character matters.
PROMPT_CONTEXT_TOKENS = 5

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The committed text is kept as one piece per step rather than one
        # growing str: appending to a str attribute copies it every time,
        # which is quadratic over a long generation.
        self._pieces: list[str] = []
        self._length = 0
        self._joined = ""  # cache of "".join(self._pieces)
        self._joined_pieces = 0
        self._sent = 0  # characters already handed out by get_delta
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

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they committed ("" while the last
        character is incomplete, or for tokens that render as nothing)."""
        if self._tokenizer is None:
            return ""
        committed = []
        for token_id in new_token_ids:
            self._ids.append(token_id)
            committed.append(self._commit_complete_text())
        return "".join(committed)

    def trim(self, num_chars: int) -> None:
        """Drop the last `num_chars` committed characters (a stop string cut)."""
        length = self._length - num_chars
        while self._length > length:
            piece = self._pieces.pop()
            self._length -= len(piece)
            if self._length < length:
                self._pieces.append(piece[: length - self._length])
                self._length = length
        # The joined cache may hold dropped text: rebuild it on demand.
        self._joined, self._joined_pieces = "", 0

    def get_delta(self, finished: bool, hold_back: int = 0) -> str:
        """Text not returned by earlier calls.

        While unfinished, the last `hold_back` committed characters are held
        back (the caller's stop strings may still claim them), and so are
        incomplete characters. finished=True flushes everything, so the deltas
        always add up to output_text.
        """
        if finished:
            self._flush_pending()
        end = self._length if finished else self._length - hold_back
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
            skip_special_tokens=self._skip_special_tokens,
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
        rendered as U+FFFD, like a full decode does. Stop strings are never
        looked for in this text: it only appears once generation has ended."""
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
        self._pieces.append(piece)
        self._length += len(piece)

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
