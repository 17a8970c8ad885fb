"""A pooling request's text as token ids, as sentence-transformers tokenizes it.

Embeddings: the model's instruction prefix (a sentence-transformers `prompt`)
goes before the text, and the tokenizer adds its special tokens, as
`SentenceTransformer.encode` does. Pairs (a cross-encoder's query and
document): the tokenizer's own pair encoding, which places the separators and,
for BERT, the token types of the second half, as `CrossEncoder.predict` does.
A checkpoint whose sentence-transformers config takes "message" inputs (a chat
model's tokenizer) has them rendered through its chat template instead, as
sentence-transformers 6 does: the prompt as a system turn, the text as the user's.

An input longer than the model takes is refused, naming the field, unless the
request asks for truncation (`truncate`: keep that many tokens, -1: as many as
the model takes), which the tokenizer does so that the special tokens stay.
Pure functions over a tokenizer: the service calls them off its event loop.
"""

from __future__ import annotations

from engine.errors import ValidationError
from engine.model.pooling.pooler import PoolingInfo


def embed_input(tokenizer, info: PoolingInfo, text: str, prompt_name: str | None = None,
                truncate: int | None = None, param: str = "input") -> tuple[list[int], None]:
    """Token ids of one text to embed (no token types: a single segment)."""
    if prompt_name is not None and prompt_name not in info.prompts:
        raise ValidationError(f"prompt_name {prompt_name!r} is not one of the model's prompts "
                              f"({', '.join(info.prompts) or 'none'})", "prompt_name")
    prefix = info.prompts[prompt_name] if prompt_name is not None else info.default_prompt
    if info.chat_inputs:  # the prompt as a system turn, the text as the user's
        system = [{"role": "system", "content": prefix}] if prefix else []
        ids = _chat_ids(tokenizer, [*system, {"role": "user", "content": text}])
        return truncated_ids(ids, info, truncate, param), None
    encoded = tokenizer(prefix + text, verbose=False, **_truncation(info, truncate))
    return check_length(encoded["input_ids"], info, param), None


def pair_input(tokenizer, info: PoolingInfo, text_1: str, text_2: str,
               truncate: int | None = None, param: str = "text_2"
               ) -> tuple[list[int], list[int] | None]:
    """Token ids of a (query, document) pair, and its token types where the model reads them."""
    if info.chat_inputs:  # sentence-transformers' roles for a pair's halves
        ids = _chat_ids(tokenizer, [{"role": "query", "content": text_1},
                                    {"role": "document", "content": text_2}])
        return truncated_ids(ids, info, truncate, param), None
    encoded = tokenizer(text_1, text_2, verbose=False, **_truncation(info, truncate))
    ids = check_length(encoded["input_ids"], info, param)
    types = encoded.get("token_type_ids") if info.token_types else None
    return ids, (list(types) if types is not None else None)


def check_length(token_ids: list[int], info: PoolingInfo, param: str) -> list[int]:
    if not token_ids:
        raise ValidationError("the input is empty", param)
    if len(token_ids) > info.max_prompt_tokens:
        raise ValidationError(
            f"the input has {len(token_ids)} tokens, more than this model's "
            f"{info.max_prompt_tokens}; shorten it or set truncate_prompt_tokens", param)
    return list(token_ids)


def truncated_ids(token_ids: list[int], info: PoolingInfo, truncate: int | None,
                  param: str = "input") -> list[int]:
    """Token ids given as such (or rendered from chat messages): the first
    `truncate` of them if asked, then checked."""
    if truncate is not None:
        token_ids = token_ids[:_limit(info, truncate)]
    return check_length(token_ids, info, param)



def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The messages through the tokenizer's chat template, as sentence-transformers
    renders a "message" input: no generation prompt after them."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _truncation(info: PoolingInfo, truncate: int | None) -> dict:
    if truncate is None:
        return {}
    return {"truncation": True, "max_length": _limit(info, truncate)}


def _limit(info: PoolingInfo, truncate: int) -> int:
    if isinstance(truncate, bool) or not isinstance(truncate, int) or truncate == 0 or truncate < -1:
        raise ValidationError(f"truncate_prompt_tokens must be -1 or an integer >= 1, got "
                              f"{truncate!r}", "truncate_prompt_tokens")
    return info.max_prompt_tokens if truncate == -1 else min(truncate, info.max_prompt_tokens)
