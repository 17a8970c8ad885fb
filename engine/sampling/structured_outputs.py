"""Structured outputs: JSON-schema, regex, choice and grammar constraints, on xgrammar.

A constrained request may only draw tokens that keep its output inside the
constraint's language. xgrammar (the library vLLM uses by default) compiles a
constraint once against the model's vocabulary; each sequence then walks it
with a matcher of its own:

    add_request   StructuredOutputs.matcher(params)  compile (cached per distinct
                                                     constraint) -> a fresh matcher
    every step    Sampler: apply_grammar_masks        each constrained row's allowed
                                                     tokens as a bitmask, applied in
                                                     one call to those rows only
    every token   StopChecker: matcher.accept(token)  the constraint complete and
                                                     its end token drawn -> "stop"

Unconstrained rows are never touched, so their tokens are the same whatever
constraints share their batch. JSON is generated compactly (no free
whitespace between tokens): a small model cannot wander off into blank lines
until max_tokens cuts it.

Why xgrammar rather than llguidance (measured on SmolLM2's 49,152-token
vocabulary, docs/performance.md): both compile our schemas in milliseconds.
llguidance's masks are faster on a typical step (median 3.5 ms against 18 ms
for 64 rows), but in two runs one step took 2.9 s and another 41 s, and such
a step stalls the whole batch; xgrammar's slowest step was 36 ms. xgrammar
also compiled every JSON-Schema keyword we tried (llguidance refuses
uniqueItems).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

import torch

from engine.errors import ValidationError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Compiled constraints kept, by bytes (xgrammar's own bounded cache).
CACHE_LIMIT_BYTES = 64 << 20
# xgrammar's errors start with "[time] source.cc:line: ": not the user's business.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")
# The request field every refusal here names: the constraint as a whole.
PARAM = "structured_outputs"


class ConstraintError(ValidationError):
    """A constraint that does not compile; `detail` says why, in xgrammar's words."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"structured_outputs.{kind} is invalid: {detail}", PARAM)
        self.kind = kind
        self.detail = detail


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's names: set exactly one of them."""

    json: str | dict | None = None  # a JSON Schema (object or its text)
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # an EBNF grammar (xgrammar's dialect, GBNF-like)
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        chosen = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(chosen) != 1:
            raise ValidationError(f"structured_outputs: set exactly one of {', '.join(KINDS)}; "
                                  f"got {', '.join(chosen) or 'none'}", PARAM)
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.choice is not None:
            choice = self.choice
            if (isinstance(choice, str) or not choice
                    or not all(isinstance(c, str) and c for c in choice)):
                raise ValidationError("structured_outputs.choice must be a non-empty list of "
                                      "non-empty strings", PARAM)
            object.__setattr__(self, "choice", tuple(choice))
        if not isinstance(self.json_object, bool):
            raise ValidationError("structured_outputs.json_object must be true or false", PARAM)
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValidationError(f"structured_outputs.{kind} must be a non-empty string",
                                      PARAM)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))


def _schema_text(schema) -> str:
    """The schema as JSON text. Its key order is kept: properties are generated
    in the order the schema lists them."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValidationError(f"structured_outputs.json is not valid JSON: {exc}",
                                  PARAM) from None
    if not isinstance(schema, (dict, bool)):
        raise ValidationError("structured_outputs.json must be a JSON Schema (an object)", PARAM)
    return json.dumps(schema)


class StructuredOutputs:
    """The model's constraint compiler: the vocabulary is prepared on first use
    (about 0.4 s for SmolLM2), then each distinct constraint compiles once."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler = None
        self._lock = threading.Lock()  # the loop thread checks, the engine thread compiles

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar

                if self.tokenizer is None:
                    raise ValidationError("structured_outputs needs the model's tokenizer, "
                                          "and this model has none", PARAM)
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.eos_token_ids or None)
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=1, cache_enabled=True, cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The compiled constraint; a ConstraintError naming the field when it is invalid."""
        compiler = self.compiler()
        kind = params.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(params.json, any_whitespace=False)
            if kind == "json_object":  # any object, compact like the schemas
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in params.choice))
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            detail = _LOG_PREFIX.sub("", " ".join(str(exc).split()))[:500]
            raise ConstraintError(kind, detail) from None

    def matcher(self, params: StructuredOutputsParams) -> "GrammarMatcher":
        return GrammarMatcher(self.compile(params))


class GrammarMatcher:
    """One sequence's place in its constraint."""

    def __init__(self, compiled) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advance by the drawn token; False if the constraint forbids it."""
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The constraint is complete and its end (an EOS token) was drawn."""
        return self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


def apply_grammar_masks(logits: torch.Tensor, grammars: list[GrammarMatcher | None]) -> torch.Tensor:
    """Forbid, in each constrained row, the tokens its constraint does not allow
    now (-inf). The other rows are left exactly as they are."""
    rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
    if not rows:
        return logits
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row in rows:
        grammars[row].fill_bitmask(bitmask, row)
    logits = logits.contiguous()
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
    return logits
