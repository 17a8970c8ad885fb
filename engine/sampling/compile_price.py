"""What a JSON schema's shape costs xgrammar to compile: its properties, its enum
and const values, its nesting, and, in any grammar, its alternations.

grammar_checks.py prices repetitions and patterns; a schema without either
could still take minutes (issue 57). Measured with xgrammar 0.2.9 on SmolLM2's
49,152 tokens, one thread, CPU time (docs/performance.md has the whole table;
the attack's wall times, on a busy machine, ran higher):

    optional properties of one object    ~2.6 us x n^2      256: 0.16 s, 512: 0.72 s,
      (required ones are cheap)                              800: 1.9 s, 2,500: ~2 min
    properties over the whole schema     ~n^1.6             1,024 in small objects: 0.15-0.3 s,
                                                             2,048: 0.45 s, 4,000: 1.8 s
    one enum's values (or anyOf consts)  steps up past      8,000: 0.06 s, 16,000: 0.7 s,
                                         ~10,000            50,000: ~57 s
    enum values that share long text     ~4e-8 s x the sum  2 values "a"+S, "b"+S with
      (any alternation of literals)      of lengths^2       |S| = 4,096: 2.3 s, 8,192: 7.7 s
    nesting depth (converting, before    ~depth^2.5-3       64: 0.04 s, 128: 0.24-0.43 s,
      the compile)                                           400: ~12 s

So a schema is walked (without recursion) before xgrammar sees it, and one
past any limit below is refused, naming what is too large and the limit. The
limits keep each shape alone well under half a second of one core, and the
worst schema they all accept at once near 1.2 s (1.7-1.9 s on a slower
machine), checks, converting and compiling together: 0.6-0.85 of what a refused
object of 800 optional properties takes (tests/engine/test_compile_price.py
compiles both). OpenAI-style response and tool schemas (tens of properties, a
few levels, enums of hundreds) pass far inside the limits. Any grammar, whatever its kind (a choice list, a regex, EBNF),
is also held to the alternation limits (`price_alternations`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_DEPTH = 32  # schemas nested in schemas
MAX_PROPERTIES = 1024  # object properties in the whole schema
# Each object's optional (not required) properties, squared, summed: one object of
# 256 optional properties, two of 181, or 64 of 32.
MAX_OPTIONAL_SQUARES = 1 << 16
MAX_ALTERNATIVES = 4096  # values of one enum, branches of one anyOf/oneOf, choices
MAX_VALUES = 8192  # enum and const values in the whole schema
# Characters of enum/const values (their JSON text), squared, summed: 2 values of
# 1,024 characters, 512 of 64, 8,192 of 16, or a lone const of 1,448.
MAX_VALUE_SQUARES = 1 << 21
# In any grammar: an alternation's alternatives' literal characters, squared, summed.
MAX_ALTERNATION_SQUARES = MAX_VALUE_SQUARES


class Refused(ValueError):
    """The constraint is well-formed but refused here; the message says why."""


# Keywords whose value maps names to schemas; "properties" is counted too.
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                           "dependentSchemas"})
# Keywords whose value is data, never compiled ("const" and "enum" are priced apart).
DATA = frozenset({"default", "examples"})
# Keywords whose list is a choice between schemas: an alternation.
BRANCHES = frozenset({"anyOf", "oneOf"})


# Where a node is: (its parent's path, its key), the schema itself None. Made into
# a JSON pointer only for a refusal: a string per node would cost depth^2.
Path = tuple | None


@dataclass
class _Tally:
    depth: tuple[int, Path] = (0, None)  # the deepest schema and where
    properties: int = 0
    optional_squares: int = 0
    widest: tuple[int, Path] = (0, None)  # the object with the most optional properties
    values: int = 0
    value_squares: int = 0


def price_schema(schema) -> None:
    """Refuse a JSON schema whose shape is too costly to compile (see the table above)."""
    tally = _Tally()
    stack = [(schema, None, 1)]  # a walk without recursion: depth is the client's to choose
    while stack:
        node, where, depth = stack.pop()
        if isinstance(node, dict):
            _visit(tally, stack, node, where, depth)
    _check(tally)


def _visit(tally: _Tally, stack: list, node: dict, where: Path, depth: int) -> None:
    """Count one schema object and queue the schemas inside it."""
    if depth > tally.depth[0]:
        tally.depth = (depth, where)
    for key, value in node.items():
        inner = (where, key)
        if key == "enum" and isinstance(value, list):
            _count_values(tally, value, inner)
        elif key == "const":
            _count_values(tally, [value], inner)
        elif key in DATA:
            continue
        elif key in NAMED_SCHEMAS and isinstance(value, dict):
            if key == "properties":
                _count_properties(tally, value, node.get("required"), where)
            stack.extend((item, (inner, name), depth + 1)
                               for name, item in value.items())
        elif isinstance(value, list):
            if key in BRANCHES and len(value) > MAX_ALTERNATIVES:
                raise Refused(f"the {key} at {_short(inner)} has {len(value)} branches, over "
                              f"this server's limit of {MAX_ALTERNATIVES}")
            stack.extend((item, (inner, i), depth + 1) for i, item in enumerate(value))
        elif isinstance(value, dict):
            stack.append((value, inner, depth + 1))


def _count_properties(tally: _Tally, properties: dict, required, where: Path) -> None:
    names = set(required) & set(properties) if isinstance(required, list) and all(
        isinstance(name, str) for name in required) else set()
    optional = len(properties) - len(names)
    tally.properties += len(properties)
    tally.optional_squares += optional * optional
    if optional > tally.widest[0]:
        tally.widest = (optional, where)


def _count_values(tally: _Tally, values: list, where: Path) -> None:
    if len(values) > MAX_ALTERNATIVES:
        raise Refused(f"the enum at {_short(where)} has {len(values)} values, over this "
                      f"server's limit of {MAX_ALTERNATIVES}")
    tally.values += len(values)
    tally.value_squares += sum(len(json.dumps(value)) ** 2 for value in values)


def _check(tally: _Tally) -> None:
    depth, where = tally.depth
    if depth > MAX_DEPTH:
        raise Refused(f"the schema nests {depth} levels deep (at {_short(where)}), over this "
                      f"server's limit of {MAX_DEPTH}")
    if tally.properties > MAX_PROPERTIES:
        raise Refused(f"the schema has {tally.properties} object properties in all, over "
                      f"this server's limit of {MAX_PROPERTIES}")
    if tally.optional_squares > MAX_OPTIONAL_SQUARES:
        count, where = tally.widest
        raise Refused(f"the schema's optional properties are too many to compile in time "
                      f"(the widest object, at {_short(where)}, has {count}): each object's "
                      f"count of optional properties squared, summed, is "
                      f"{tally.optional_squares}, over this server's limit of "
                      f"{MAX_OPTIONAL_SQUARES}; list them in `required`, or split the object")
    if tally.values > MAX_VALUES:
        raise Refused(f"the schema has {tally.values} enum and const values in all, over "
                      f"this server's limit of {MAX_VALUES}")
    if tally.value_squares > MAX_VALUE_SQUARES:
        raise Refused(f"the schema's enum and const values are too long to compile in time: "
                      f"the lengths of their JSON texts squared, summed, are "
                      f"{tally.value_squares}, over this server's limit of "
                      f"{MAX_VALUE_SQUARES}: {MAX_VALUE_SQUARES >> 20} values of 1,024 "
                      f"characters, or {MAX_VALUE_SQUARES >> 12} of 64")


def _short(where: Path, limit: int = 120) -> str:
    """The JSON pointer to a node, cut to a readable length (a deep one runs to kilobytes)."""
    keys = []
    while where is not None:
        where, key = where
        keys.append(str(key).replace("~", "~0").replace("/", "~1"))
    pointer = "/".join(["#", *reversed(keys)])
    return pointer if len(pointer) <= limit else f"{pointer[:limit // 2]}...{pointer[-limit // 2:]}"


def price_choices(choices) -> None:
    """structured_outputs.choice, priced as the enum it amounts to."""
    if len(choices) > MAX_ALTERNATIVES:
        raise Refused(f"it has {len(choices)} choices, over this server's limit of "
                      f"{MAX_ALTERNATIVES}")
    squares = sum(len(choice) ** 2 for choice in choices)
    if squares > MAX_VALUE_SQUARES:
        raise Refused(f"its choices are too long to compile in time: their lengths squared, "
                      f"summed, are {squares}, over this server's limit of {MAX_VALUE_SQUARES}")


def price_alternations(rules: dict[str, list]) -> None:
    """Refuse a normalised grammar with an alternation too costly to compile.

    `rules` maps each rule's name to its body's tokens (grammar_checks' _TOKEN
    matches). Each group's alternatives, and a rule body's, are counted, with
    the literal characters of each (a nested group's added to the alternative
    it sits in)."""
    for name, tokens in rules.items():
        for count, squares in _alternations(tokens):
            if count > MAX_ALTERNATIVES:
                raise Refused(f"its rule {name!r} has an alternation of {count} alternatives, "
                              f"over this server's limit of {MAX_ALTERNATIVES}")
            if squares > MAX_ALTERNATION_SQUARES:
                raise Refused(f"its rule {name!r} has alternatives too long to compile in "
                              f"time: their literal characters squared, summed, are "
                              f"{squares}, over this server's limit of "
                              f"{MAX_ALTERNATION_SQUARES}")


def _alternations(tokens: list):
    """(alternatives, sum of their literal characters squared) of each alternation."""
    frames = [[[], 0]]  # per open group: [finished alternatives' characters, current's]
    for token in tokens:
        kind = token.lastgroup
        op = token["op"] if kind == "op" else None
        if op in ("(", "(="):
            frames.append([[], 0])
        elif op == ")" and len(frames) > 1:
            done, current = frames.pop()
            yield from _closed(done + [current], frames[-1])
        elif op == "|":
            frames[-1][0].append(frames[-1][1])
            frames[-1][1] = 0
        elif kind in ("lit", "cls"):
            frames[-1][1] += len(token[kind]) - 2 if kind == "lit" else 1
    while len(frames) > 1:  # unbalanced: xgrammar printed it, so never seen
        done, current = frames.pop()
        yield from _closed(done + [current], frames[-1])
    done, current = frames[0]
    if done:
        yield len(done) + 1, sum(c * c for c in done) + current * current


def _closed(alternatives: list[int], parent: list) -> list[tuple[int, int]]:
    parent[1] += sum(alternatives)
    if len(alternatives) < 2:
        return []
    return [(len(alternatives), sum(c * c for c in alternatives))]
