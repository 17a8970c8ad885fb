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

SentencePiece byte fallback needs one more rule. Its "<0xNN>" tokens are
decoded a run at a time (tokenizers' ByteFallback decoder): a run that is not
valid UTF-8 as a whole becomes one U+FFFD per byte, characters already
complete in it included. So "é" from <0xC3><0xA9> is not final until the run
ends: for such tokenizers (found by `byte_run_token_ids`), text is committed
only when the last token that renders is not a byte token -- a byte run's
text comes out with the token after it, or with the final flush -- and a
window never starts inside a run. Byte-level BPE (GPT-2 style) decodes a
complete character for good, and streams it at once.

Contract with the engine:
- output_text equals tokenizer.decode(fed_ids, skip_special_tokens=...,
  clean_up_tokenization_spaces=False), minus what `trim` removed. The window
  is seeded with the prompt's last tokens, so with SentencePiece tokenizers a
  leading space of the first output token is kept (as vLLM does) where a bare
  decode of the output would drop it: output_text is then the text the output
  adds to the prompt's, decode(prompt + output)[len(decode(prompt)):]. Where
  the two do not join (the prompt ends inside a character, or a byte run of
  the prompt and one of the output are invalid together), it is
  decode(output) alone.
- The detokenizer knows nothing about stopping: which tokens become text, where
  a stop string cuts it and how much of a stream is held back are decided in
  engine/sampling/stopping.py, which feeds it and tells it.
"""

from __future__ import annotations

import weakref
from typing import Any

# How many prompt tokens seed the window. They give the first output token
# its real left context (e.g. a SentencePiece leading space is kept), and a
# few are enough since only the last complete character matters (the
# context is widened to the start of a byte-fallback run it ends in).
PROMPT_CONTEXT_TOKENS = 5

REPLACEMENT_CHAR = "\ufffd"

_BYTE_TOKENS = [f"<0x{byte:02X}>" for byte in range(256)]
_facts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_run_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of a tokenizer's "<0xNN>" byte-fallback tokens when its decode
    can turn complete characters of a byte run into U+FFFD once later bytes
    make the run invalid (tokenizers' ByteFallback decoder: Llama, Mistral,
    Gemma, Phi-3 ...). Empty for any other tokenizer."""
    return _tokenizer_facts(tokenizer)[0]


def _tokenizer_facts(tokenizer: Any) -> tuple[frozenset[int], frozenset[int]]:
    """(byte-run token ids, special token ids), cached per tokenizer until
    its vocabulary size changes (tokens were added)."""
    try:
        size = len(tokenizer)
    except TypeError:
        size = None
    try:
        cached_size, facts = _facts[tokenizer]
        if cached_size == size:
            return facts
    except (KeyError, TypeError):
        pass
    facts = (_find_byte_run_ids(tokenizer), _special_token_ids(tokenizer))
    try:
        _facts[tokenizer] = (size, facts)
    except TypeError:  # not weak-referenceable: found again next time
        pass
    return facts


def _find_byte_run_ids(tokenizer: Any) -> frozenset[int]:
    try:
        ids = list(tokenizer.convert_tokens_to_ids(_BYTE_TOKENS))
    except (AttributeError, KeyError, TypeError, ValueError):
        return frozenset()
    unknown = getattr(tokenizer, "unk_token_id", None)
    if None in ids or unknown in ids or len(set(ids)) != len(ids):
        return frozenset()
    e_acute = [ids[0xC3], ids[0xA9]]
    if _plain_decode(tokenizer, e_acute) != "é":
        return frozenset()  # not byte tokens after all
    # 0xFF is never valid UTF-8: does it take the "é" before it down too?
    if _plain_decode(tokenizer, e_acute + [ids[0xFF]]).startswith("é"):
        return frozenset()  # decoded character by character (sentencepiece)
    return frozenset(ids)


def _plain_decode(tokenizer: Any, token_ids: list[int]) -> str:
    return tokenizer.decode(
        token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids a decode with skip_special_tokens drops: they do not end a run."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)


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
        # Byte-fallback tokens, and the special tokens a decode skips (which
        # leave a byte run open); both empty unless the tokenizer needs them.
        byte_ids, special_ids = (
            _tokenizer_facts(tokenizer) if tokenizer is not None else (frozenset(), frozenset()))
        self._byte_ids = byte_ids
        self._skipped_ids = special_ids if skip_special_tokens else frozenset()
        self._ids = self._initial_context(list(prompt_token_ids))
        # Prompt tokens at the window's start, until the first commit.
        self._context_len = len(self._ids)
        self._run_open = False  # does the last token that renders end a byte run?
        for token_id in self._ids:
            self._track_byte_run(token_id)
        # _ids[prefix_offset:read_offset] is the last committed chunk, kept
        # as left context; _ids[read_offset:] is not yet text.
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode of that chunk, once made

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
            self._track_byte_run(token_id)
            # An open byte run may still be rewritten: no need to decode yet.
            if not self._run_open:
                committed.append(self._commit_complete_text())
        return "".join(committed)

    def flush(self) -> str:
        """Commit the pending tokens' text as it stands and return it: the
        sequence has ended. It holds an open byte run's text, or tokens that
        never completed a character (rendered as U+FFFD, as a full decode
        does)."""
        pending = self._pending_text()
        if pending:
            self._commit_pending(pending)
        return pending

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
            self.flush()
        end = self._length if finished else self._length - hold_back
        if end <= self._sent:
            return ""
        delta = self._text_since(self._sent)[: end - self._sent]
        self._sent = end
        return delta

    def _initial_context(self, prompt_token_ids: list[int]) -> list[int]:
        if self._tokenizer is None:
            return []
        start = max(len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS, 0)
        # Start on a token that renders and is no byte-fallback token: a byte
        # run is decoded as a whole, and the first token that renders loses
        # its SentencePiece leading space.
        while start > 0 and self._in_byte_run(prompt_token_ids[start]):
            start -= 1
        context = prompt_token_ids[start:]
        # A prompt cut inside a character would make the first output
        # character merge with it; decoding the output on its own is then the
        # only answer consistent with tokenizer.decode(output_ids).
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            return []
        return context

    def _in_byte_run(self, token_id: int) -> bool:
        return token_id in self._byte_ids or token_id in self._skipped_ids

    def _track_byte_run(self, token_id: int) -> None:
        if token_id in self._byte_ids:
            self._run_open = True
        elif token_id not in self._skipped_ids:
            self._run_open = False

    def _decode(self, token_ids: list[int]) -> str:
        # Clean-up of tokenization spaces rewrites text across token
        # boundaries (" ." -> "."), which would make the window difference
        # wrong; vLLM does not apply it either.
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _commit_complete_text(self) -> str:
        """Commit the text of pending tokens if it ends on a whole character;
        return what was committed ("" when nothing was)."""
        piece = self._pending_text()
        # Empty: a skipped special token adds nothing, and some tokenizers
        # render an incomplete byte sequence as nothing at all.
        if not piece or piece.endswith(REPLACEMENT_CHAR):
            return ""
        self._commit_pending(piece)
        return piece

    def _pending_text(self) -> str:
        """The text the pending tokens add: the window's decode past the
        committed chunk's."""
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        prefix_text = self._prefix_text
        window_text = self._decode(self._ids[self._prefix_offset :])
        if self._context_len and not window_text.startswith(prefix_text):
            # The output's first bytes rewrote the prompt's last characters
            # (a byte run invalid as a whole): the output stands alone. The
            # next chunk is then exactly that output, so windows agree.
            return self._decode(self._ids[self._context_len :])
        return window_text[len(prefix_text) :]

    def _commit_pending(self, piece: str) -> None:
        self._commit(piece)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        self._context_len = 0

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
