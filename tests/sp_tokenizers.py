"""Toy SentencePiece-style tokenizers, trained offline in well under a second.

Llama-2, Mistral, Phi-3 and Gemma use SentencePiece vocabularies: spaces are
the "▁" metasymbol, a decode drops the leading space of its first token
(except Gemma's), and characters outside the vocabulary fall back to one
"<0xNN>" token per UTF-8 byte. These builders reproduce that with a small
corpus whose rare characters (accents, CJK, emoji) are left out of the
vocabulary, so they are spelled in byte-fallback tokens.

- `llama_style`: a `tokenizers` BPE model wrapped in transformers'
  LlamaTokenizer (Metaspace pre-tokenizer, prepend_scheme="first", decoder
  Replace + ByteFallback + Fuse + Strip), as Llama/Mistral/Phi-3 load today.
- `gemma_style`: the same vocabulary in GemmaTokenizer (no prefix space).
- `unigram_metaspace`: a Unigram model with byte fallback and a Metaspace
  decoder, which drops every "▁" of the decode's first token.
- `sentencepiece_llama`: a real sentencepiece BPE model (SentencePieceTrainer,
  byte_fallback=True) saved as tokenizer.model and loaded by LlamaTokenizer,
  i.e. the conversion a Llama checkpoint without tokenizer.json goes through.
  It needs the sentencepiece and protobuf packages (the dev extra).

Each builder saves the tokenizer to `folder` and returns it reloaded from
there, so what is tested is what AutoTokenizer.from_pretrained gives.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

# Common words make the merges. Rare characters appear once: most stay out of
# the vocabularies and are spelled in byte tokens, a few get a piece.
_COMMON = (
    "the quick brown fox jumps over the lazy dog and then it runs away "
    "hello world this is a small test of the tokenizer with some words "
    "streaming text one token at a time must give the same text as a full decode "
    "numbers 0123456789 and punctuation: commas, dots. questions? yes! (maybe) "
)
_RARE = (
    "café naïve résumé über straße ñandú ", "日本語 世界 中文 테스트 ",
    "🤖 🎉 👩‍👩‍👧‍👦 🇫🇷 ∑∫√ ", "Ελληνικά русский עברית ",
)
CORPUS = [_COMMON * 3] * 20 + list(_RARE)

# Texts the tests draw from: common words, spacing, byte-fallback characters.
SAMPLE_TEXT = (
    "héllo 🤖 世界 🇫🇷 ... The quick brown fox — naïve café, 👩‍👩‍👧‍👦 family; "
    "日本語のテキストです。Ελληνικά, русский текст. Ünïcödé «quotes» "
    "tabs\tand\nnewlines   spaces  1234567890 ∑∫√ 🎉🎉🎉 end ▁ <0x41>"
)

_BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
_LLAMA_SPECIALS = ["<unk>", "<s>", "</s>"]


def _train_bpe(vocab_size: int = 400) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A Metaspace BPE vocabulary laid out as Llama's: specials, 256 byte
    tokens, then the learnt pieces."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    # Pieces never span words, as sentencepiece's ("▁fox", not "x▁fox").
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, limit_alphabet=60, special_tokens=[], show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    learnt = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    vocab = {token: i for i, token in enumerate(_LLAMA_SPECIALS + _BYTE_TOKENS)}
    for token, _ in learnt:
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(tokenizer.to_str())["model"]["merges"]]
    return vocab, merges


def _save_and_reload(tokenizer, folder: Path):
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


def llama_style(folder: Path):
    from transformers import LlamaTokenizer

    vocab, merges = _train_bpe()
    tokenizer = LlamaTokenizer(vocab=vocab, merges=merges, legacy=False, add_prefix_space=True)
    return _save_and_reload(tokenizer, folder)


def gemma_style(folder: Path):
    from transformers import GemmaTokenizer

    vocab, merges = _train_bpe()
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    learnt = [token for token in vocab if token not in _LLAMA_SPECIALS]
    gemma_vocab = {token: i for i, token in enumerate(specials + learnt)}
    return _save_and_reload(GemmaTokenizer(vocab=gemma_vocab, merges=merges), folder)


def unigram_metaspace(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=250, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>",
        initial_alphabet=[], max_piece_length=8, show_progress=False)
    tokenizer.train_from_iterator([_COMMON * 3] * 20, trainer)  # no rare characters at all
    pieces = [tuple(piece) for piece in json.loads(tokenizer.to_str())["model"]["vocab"]]
    pieces += [(token, -30.0) for token in _BYTE_TOKENS]
    tokenizer.model = models.Unigram(pieces, unk_id=0, byte_fallback=True)
    tokenizer.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="always")])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return _save_and_reload(wrapped, folder)


def sentencepiece_llama(folder: Path):
    """A real sentencepiece model, converted by LlamaTokenizer as for a
    checkpoint that only ships tokenizer.model."""
    import sentencepiece
    from transformers import LlamaTokenizer

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=320,
        model_type="bpe", byte_fallback=True, character_coverage=0.98,
        split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    tokenizer = LlamaTokenizer.from_pretrained(str(folder), legacy=False)
    return _save_and_reload(tokenizer, folder)


BUILDERS = {
    "llama": llama_style,
    "gemma": gemma_style,
    "unigram": unigram_metaspace,
    "sentencepiece": sentencepiece_llama,
}
