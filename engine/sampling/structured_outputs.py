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
constraints share their batch. JSON is generated on one line with no free
whitespace, laid out as Python's json.dumps writes it (", " between items,
": " after keys): a small model cannot wander off into blank lines until
max_tokens cuts it.

Before compiling, grammar_checks.py prices the constraint (xgrammar's compile
time is the client's to choose otherwise) and refuses one that accepts no
output at all.

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
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.errors import ValidationError
from engine.sampling.compile_price import price_choices
from engine.sampling.grammar_checks import Refused, check_grammar, check_schema

logger = logging.getLogger(__name__)

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Compiled constraints kept, by bytes (xgrammar's own bounded cache, and ours).
CACHE_LIMIT_BYTES = 64 << 20
# xgrammar's errors start with "[time] source.cc:line: ": not the user's business.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")
# An internal failure of xgrammar's (its CHECK macro's words): never shown to a
# client, who gets INTERNAL_FAILURE instead; the server's log has the details.
_ASSERTION = "Check failed"
INTERNAL_FAILURE = ("it could not be compiled: the grammar engine failed on it (logged on "
                    "the server); try a simpler form")
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


def choice_grammar(choices: tuple[str, ...]) -> str:
    """The EBNF of "one of these strings". Each is a JSON string literal with its
    characters as they are: ensure_ascii would write an emoji as a UTF-16
    surrogate pair, which xgrammar reads as two code points (mojibake)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


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
        self._compilers = None  # (cached, uncached), made on first use
        self._lock = threading.Lock()  # the loop thread checks, the engine thread compiles
        # Recently compiled constraints, by their params, within CACHE_LIMIT_BYTES.
        self._recent: OrderedDict[StructuredOutputsParams, object] = OrderedDict()
        self._recent_bytes = 0
        self._recent_lock = threading.Lock()

    def compiler(self, cached: bool = True):
        """xgrammar's compiler for this vocabulary: the shared, cached one, or one
        without a cache for the grammars the cache fails on."""
        with self._lock:
            if self._compilers is None:
                import xgrammar

                if self.tokenizer is None:
                    raise ValidationError("structured_outputs needs the model's tokenizer, "
                                          "and this model has none", PARAM)
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.eos_token_ids or None)
                self._compilers = (
                    xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                             cache_limit_bytes=CACHE_LIMIT_BYTES),
                    xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False))
            return self._compilers[0 if cached else 1]

    def price(self, params: StructuredOutputsParams) -> None:
        """The checks that need no xgrammar, alone (a ConstraintError when one fails):
        a schema's or a choice list's price (compile_price.py), its patterns and
        references. Cheap, so a server runs them before queueing the compile;
        `compile` runs them again."""
        try:
            if params.kind == "json":
                check_schema(json.loads(params.json))
            elif params.kind == "choice":
                price_choices(params.choice)
        except Refused as exc:
            raise ConstraintError(params.kind, str(exc)) from None

    def compile(self, params: StructuredOutputsParams):
        """The compiled constraint; a ConstraintError naming the field when it is invalid.

        Parsed into xgrammar's Grammar first (a client's mistake is refused in
        xgrammar's words), checked (grammar_checks.py: bounded cost, a
        language that is not empty), then compiled. The request's check and
        the engine's matcher compile the same constraint: the second time
        comes from `_recent`, without parsing or checking again.
        """
        with self._recent_lock:
            compiled = self._recent.get(params)
            if compiled is not None:
                self._recent.move_to_end(params)
                return compiled
        compiled = self._compile(params.kind, self._grammar(params))
        with self._recent_lock:
            twin = self._recent.pop(params, None)  # another thread compiled it meanwhile
            self._recent_bytes -= 0 if twin is None else twin.memory_size_bytes
            self._recent[params] = compiled
            self._recent_bytes += compiled.memory_size_bytes
            while self._recent_bytes > CACHE_LIMIT_BYTES and len(self._recent) > 1:
                self._recent_bytes -= self._recent.popitem(last=False)[1].memory_size_bytes
        return compiled

    def _grammar(self, params: StructuredOutputsParams):
        import xgrammar

        kind = params.kind
        try:
            if kind == "json":
                check_schema(json.loads(params.json))  # before converting: patterns cost there
                grammar = xgrammar.Grammar.from_json_schema(params.json, any_whitespace=False)
            elif kind == "json_object":  # any object, laid out like the schemas
                grammar = xgrammar.Grammar.from_json_schema('{"type": "object"}',
                                                            any_whitespace=False)
            elif kind == "regex":
                grammar = xgrammar.Grammar.from_regex(params.regex)
            else:
                if kind == "choice":
                    price_choices(params.choice)
                grammar = xgrammar.Grammar.from_ebnf(
                    params.grammar if kind == "grammar" else choice_grammar(params.choice))
            check_grammar(str(grammar))
        except Refused as exc:
            raise ConstraintError(kind, str(exc)) from None
        except (RuntimeError, ValueError, TypeError) as exc:
            detail = _LOG_PREFIX.sub("", " ".join(str(exc).split()))[:500]
            if _ASSERTION in detail:  # xgrammar's own invariant, not the client's mistake
                logger.error("structured_outputs.%s: xgrammar failed parsing it: %s", kind,
                             detail)
                detail = INTERNAL_FAILURE
            raise ConstraintError(kind, detail) from None
        return grammar

    def _compile(self, kind: str, grammar):
        """A parsed and checked grammar compiled; any failure now is xgrammar's own."""
        try:
            return self.compiler().compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            # xgrammar 0.2.8's cache fails an assertion on some grammars (a pattern
            # repeated 150 times or more); without the cache they compile.
            logger.debug("structured_outputs.%s: compiling again without the cache (%s)",
                         kind, exc)
        try:
            return self.compiler(cached=False).compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError):
            logger.exception("structured_outputs.%s: xgrammar failed to compile a grammar it "
                             "had parsed", kind)
            raise ConstraintError(kind, INTERNAL_FAILURE) from None

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

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepts (drafts verified ahead of the stop checker)."""
        self._matcher.rollback(num_tokens)

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
