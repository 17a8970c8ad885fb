"""Each token's raw bytes: what logprobs report, and what bounds a prompt's size.

A token's text is not its bytes. A byte-level BPE token may hold part of a
character (an emoji is often two tokens, "\\xf0\\x9f" and "\\x98\\x80"), and
decoded alone it reads as U+FFFD. OpenAI's logprobs carry each token's own
bytes so that a client can join them into the real text; so does this table,
built once per tokenizer from its vocabulary:

    byte-level BPE (GPT-2, Llama 3, SmolLM2)   "ĠhÃ©"  -> b" h\\xc3\\xa9"  (GPT-2's byte map)
    SentencePiece with byte fallback (Llama 2)  "▁hi"   -> b" hi",  "<0xF0>" -> b"\\xf0"
    added tokens ("<|im_start|>")               their content, UTF-8
    anything else                               the decoded text, UTF-8

The longest entry also bounds a text's token count from below: no token
covers more than `longest` bytes, so a text of N bytes (or N characters) is at
least N / longest tokens, which lets the server refuse an oversized prompt
before it spends time tokenizing it.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable

from transformers.convert_slow_tokenizer import bytes_to_unicode


class TokenBytes:
    def __init__(self, tokenizer) -> None:
        size = len(tokenizer)
        decoder = _decoder_types(tokenizer)
        tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        if "ByteLevel" in decoder:
            byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
            convert = lambda i, t: _from_byte_level(t, byte_of)  # noqa: E731
        elif "ByteFallback" in decoder or "Metaspace" in decoder or "Replace" in decoder:
            convert = lambda i, t: _from_sentencepiece(t)  # noqa: E731
        else:
            convert = lambda i, t: tokenizer.decode([i]).encode()  # noqa: E731
        self.table: list[bytes] = [
            added[i].encode() if i in added else convert(i, t or "")
            for i, t in enumerate(tokens)
        ]
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.longest = max(1, max(map(len, self.table), default=1))

    def __getitem__(self, token_id: int) -> bytes:
        return self.table[token_id]

    def min_tokens(self, text_size: int) -> int:
        """The fewest tokens a text of `text_size` bytes or characters can become."""
        return -(-text_size // self.longest)


class TextOffsets:
    """Where each token starts in a choice's text, in characters (legacy logprobs).

    Fed the tokens in order, possibly across many stream chunks. A token that
    ends inside a character adds nothing yet: the character counts once it is
    complete, as in the text, where the detokenizer holds partial characters
    back. Special tokens add nothing when the text skips them.
    """

    def __init__(self, token_bytes: TokenBytes, skip_special_tokens: bool) -> None:
        self._bytes = token_bytes
        self._skip = token_bytes.special_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def advance(self, token_ids: Iterable[int]) -> list[int]:
        """The start offset of each of `token_ids`; moves past them."""
        offsets = []
        for token_id in token_ids:
            offsets.append(self.chars)
            if token_id not in self._skip:
                self.chars += len(self._decoder.decode(self._bytes[token_id]))
        return offsets


def _decoder_types(tokenizer) -> set[str]:
    """The type names in the fast tokenizer's decoder (a Sequence lists its parts)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return {part.get("type", "") for part in parts}


def _from_byte_level(token: str, byte_of: dict[str, int]) -> bytes:
    if all(char in byte_of for char in token):
        return bytes(byte_of[char] for char in token)
    return token.encode()


def _from_sentencepiece(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("\u2581", " ").encode()
