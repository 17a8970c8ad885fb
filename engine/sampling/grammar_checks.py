"""Cheap checks on a constraint before xgrammar compiles it: bounded cost, a
non-empty language, references inside the schema.

xgrammar's compile time depends on the constraint in ways a client controls
(measured on SmolLM2's 49,152 tokens, one thread):

    a repetition of one character class    ~13 ms per count, up to ~2 s from 128:
    ([^"]{0,100}, "maxLength": 100)         each distinct bound pays it again
    a JSON-schema "pattern"                 quadratic in its expanded size
                                            ([a-z]{1,4400}: 0.9 s), and nested
                                            ranged repetitions explode
                                            ((.{1,10}){1,10}: 17 s, (.?){1,100}: minutes)

So each is priced here before anything is compiled, and a constraint over
budget is refused (a schema's properties, enum values and nesting, and any
grammar's alternations, are priced in compile_price.py): `REPEAT_BUDGET`
units of repeated character classes (a unit is one count, `min(bound,
REPEAT_CAP)` per distinct repetition), and per pattern an expanded size of at
most `MAX_PATTERN_SIZE` (all of a schema's at most `MAX_PATTERNS_SIZE`) with
nested repetitions whose bounds multiply to at most `MAX_NESTED_REPEAT`. The
grammar is read in xgrammar's own normalised EBNF (`str(Grammar)`), whatever
the constraint's kind.

A grammar whose root can never finish (`root ::= root`, a schema that is only a
$ref to itself) accepts no output at all, and would run to max_tokens: refused
too. So is a $ref that is not a JSON pointer into the schema itself: nothing is
ever fetched.
"""

from __future__ import annotations

import re
from collections import deque
from urllib.parse import unquote

from engine.sampling.compile_price import Refused, price_alternations, price_schema

REPEAT_BUDGET = 1024
REPEAT_CAP = 150
MAX_PATTERN_SIZE = 1000
MAX_PATTERNS_SIZE = 2000
MAX_NESTED_REPEAT = 16


# -- regular expressions (JSON-schema patterns) ------------------------------------------
_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:(,)\s*(\d*)\s*)?\}")


def regex_cost(pattern: str) -> tuple[int, int]:
    """(expanded size, largest product of nested repetition bounds) of a regex.

    Dialect-blind on purpose: atoms are characters, escapes and classes;
    alternatives add up; a repetition multiplies what it repeats.
    """
    frames = [[0, 0]]  # per open group: [size, largest repetition product inside]
    last: list[int] | None = None  # the latest atom or group: [size, product]
    nested = 0
    i = 0
    while i < len(pattern):
        char = pattern[i]
        bounds, end = _quantifier(pattern, i)
        if bounds is not None:
            if last is not None:
                nested = max(nested, _repeat(last, *bounds))
            i = end + (end < len(pattern) and pattern[end] in "?+")  # lazy, possessive
            continue
        _commit(frames[-1], last)
        last = None
        if char == "(":
            frames.append([0, 0])
            i = _group_start(pattern, i + 1)
            continue
        if char == ")" and len(frames) > 1:
            last = frames.pop()
        elif char != "|":
            last = [1, 0]
            i = _atom_end(pattern, i) - 1
        i += 1
    _commit(frames[-1], last)
    while len(frames) > 1:  # unclosed groups: xgrammar refuses them anyway
        _commit(frames[-2], frames.pop())
    return frames[0][0], nested


def _quantifier(pattern: str, i: int) -> tuple[tuple[int, int | None] | None, int]:
    char = pattern[i]
    if char in "*+?":
        return ((0, None) if char == "*" else (1, None) if char == "+" else (0, 1)), i + 1
    match = _QUANTIFIER.match(pattern, i) if char == "{" else None
    if match is None or not (match.group(1) or match.group(3)):
        return None, i
    low = int(match.group(1) or 0)
    high = int(match.group(3)) if match.group(3) else (None if match.group(2) else low)
    return (low, high), match.end()


def _repeat(item: list[int], low: int, high: int | None) -> int:
    """Apply a repetition to an atom or group in place; the nested product it makes."""
    item[0] *= high if high is not None else max(low, 1)
    weight = max(high if high is not None else low, 2)
    nested = weight * item[1] if item[1] else 0
    item[1] = weight * (item[1] or 1)
    return nested


def _commit(frame: list[int], item: list[int] | None) -> None:
    if item is not None:
        frame[0] += item[0]
        frame[1] = max(frame[1], item[1])


def _group_start(pattern: str, i: int) -> int:
    """Past a group's opening modifiers: (?: (?= (?! (?<= (?<! (?<name>."""
    if pattern.startswith("?<", i) and not pattern.startswith(("?<=", "?<!"), i):
        end = pattern.find(">", i)
        return len(pattern) if end < 0 else end + 1
    if pattern.startswith(("?<=", "?<!"), i):
        return i + 3
    return i + 2 if pattern.startswith("?", i) else i


def _atom_end(pattern: str, i: int) -> int:
    """Where the atom at i ends: a character, an escape or a whole class."""
    if pattern[i] == "\\":
        if pattern.startswith(("p{", "P{", "u{"), i + 1):
            end = pattern.find("}", i)
            return len(pattern) if end < 0 else end + 1
        return min(i + 2, len(pattern))
    if pattern[i] != "[":
        return i + 1
    j = i + 1 + pattern.startswith("^", i + 1)
    j += pattern.startswith("]", j)  # a leading ] is a member
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return min(j + 1, len(pattern))


def check_pattern(pattern: str, where: str) -> int:
    """Refuse a pattern too costly to compile; its expanded size otherwise."""
    size, nested = regex_cost(pattern)
    if size > MAX_PATTERN_SIZE:
        raise Refused(f"the pattern at {where} expands to {size} characters, over this "
                      f"server's limit of {MAX_PATTERN_SIZE}: use smaller repetition bounds")
    if nested > MAX_NESTED_REPEAT:
        raise Refused(f"the pattern at {where} nests repetitions whose bounds multiply to "
                      f"{nested}, over this server's limit of {MAX_NESTED_REPEAT}")
    return size


# -- JSON schemas -----------------------------------------------------------------------
# Keywords whose value is data, not a schema: a "$ref" or "pattern" in it is just data.
VALUES = frozenset({"const", "enum", "default", "examples"})
# Keywords whose value maps names (any word, "enum" too) to schemas.
MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                  "dependentSchemas"})


def check_schema(schema) -> None:
    """Its shape priced (compile_price.py), every pattern priced; every $ref a pointer
    into this schema that resolves."""
    price_schema(schema)
    total = 0
    stack = [(schema, "#", False)]
    while stack:
        node, where, names = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{where}/{i}", False) for i, item in enumerate(node))
        elif isinstance(node, dict) and names:
            stack.extend((value, f"{where}/{key}", False) for key, value in node.items())
        elif isinstance(node, dict):
            for key, value in node.items():
                inner = f"{where}/{key}"
                if key == "pattern" and isinstance(value, str):
                    total += check_pattern(value, inner)
                elif key == "patternProperties" and isinstance(value, dict):
                    total += sum(check_pattern(p, f"{inner}/{p}") for p in value)
                elif key == "$ref" and isinstance(value, str):
                    _resolve(schema, value, inner)
                    _check_ref_chain(schema, node, where)
                if key not in VALUES:
                    stack.append((value, inner, key in MAPS))
    if total > MAX_PATTERNS_SIZE:
        raise Refused(f"the schema's patterns expand to {total} characters in all, over this "
                      f"server's limit of {MAX_PATTERNS_SIZE}")


def _resolve(schema, ref: str, where: str):
    """The node a $ref points to; Refused unless it is a pointer into `schema` that resolves."""
    if ref == "#":
        return schema
    if not ref.startswith("#/"):
        raise Refused(f"the $ref {ref!r} at {where} is not a JSON pointer into this schema "
                      "('#' or '#/...'): remote, file and anchor references are never fetched")
    node = schema
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise Refused(f"the $ref {ref!r} at {where} does not resolve inside this schema")
    return node


# Keys that hold no schema content of their own: a node with only these and a
# $ref stands for its target and nothing else.
NO_CONTENT = frozenset({"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title",
                        "description"})


def _check_ref_chain(schema, node, where: str) -> None:
    """A schema that is only a $ref to a schema that is only a $ref ... and
    back accepts no output. Refused here in the words check_grammar uses for
    any grammar that cannot finish (xgrammar 0.2.9 and later refuse such a
    chain themselves when converting, in words of their own)."""
    seen: list = []
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and set(node) <= NO_CONTENT:
        if any(node is earlier for earlier in seen):
            raise Refused(f"it accepts no output at all: the $ref at {where} only leads back "
                          "to itself through schemas with no content of their own")
        seen.append(node)
        node = _resolve(schema, node["$ref"], where)


# -- xgrammar's normalised EBNF ---------------------------------------------------------
_TOKEN = re.compile(r'''\s*(?:
    (?P<lit>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<call>[A-Za-z_]\w*\((?:"(?:[^"\\]|\\.)*"|[^()"])*\))
  | (?P<rep>\{\s*(?P<lo>-?\d+)\s*,\s*(?P<hi>-?\d+)\s*\})
  | (?P<name>[A-Za-z_][\w.\-]*)
  | (?P<op>\(=|[()|*+?])
  | (?P<other>\S)
)''', re.X | re.S)
_RULE = re.compile(r"([A-Za-z_][\w.\-]*) ::= ")
TERMINAL = ("t",)


def check_grammar(text: str) -> None:
    """Refuse a normalised grammar that is too costly to compile or accepts nothing."""
    rules = {}
    for line in text.splitlines():
        head = _RULE.match(line)
        if head is not None:
            rules[head.group(1)] = [m for m in _TOKEN.finditer(line, head.end())
                                    if m.lastgroup is not None]
    price_alternations(rules)
    cost = _repeat_cost(rules)
    if cost > REPEAT_BUDGET:
        raise Refused(f"its repeated character classes (maxLength, minLength, {{m,n}}) cost "
                      f"{cost} units to compile, over this server's budget of {REPEAT_BUDGET}: "
                      f"use fewer distinct bounds or smaller ones (each costs up to "
                      f"{REPEAT_CAP})")
    if "root" in rules and "root" not in _productive(rules):
        raise Refused("it accepts no output at all: every way through it recurses forever "
                      "(a rule or $ref that only leads back to itself)")


def _repeat_cost(rules: dict[str, list[re.Match]]) -> int:
    """Units of repeated character classes, each distinct (class, bounds) once."""
    seen = set()
    for tokens in rules.values():
        for before, token in zip([None, *tokens], tokens):
            if token.lastgroup != "rep" or before is None:
                continue
            element = _single_class(before, rules)
            if element is not None:
                seen.add((element, int(token["lo"]), int(token["hi"])))
    return sum(min(hi if hi >= 0 else max(lo, 1), REPEAT_CAP) for _, lo, hi in seen)


def _single_class(token: re.Match, rules: dict[str, list[re.Match]]) -> str | None:
    """The character class a repeated element is (itself, or a rule of just it), else None.

    A repeated group counts as a class: the printer gives groups rules of their own."""
    if token.lastgroup == "cls":
        return token["cls"]
    if token.lastgroup == "op" and token["op"] == ")":
        return f"group {token.start()}"
    if token.lastgroup != "name" or token["name"] not in rules:
        return None
    body = [t for t in rules[token["name"]] if t.lastgroup != "op" or t["op"] not in "()"]
    return body[0]["cls"] if len(body) == 1 and body[0].lastgroup == "cls" else None


def _productive(rules: dict[str, list[re.Match]]) -> set[str]:
    """The rules that can finish (derive some finite text): a least fixed point."""
    trees = {name: _Parser(tokens).alternatives() for name, tokens in rules.items()}
    users: dict[str, list[str]] = {name: [] for name in rules}
    for name, tree in trees.items():
        for used in _references(tree):
            users.get(used, []).append(name)
    productive: set[str] = set()
    pending = deque(rules)
    while pending:
        name = pending.popleft()
        if name not in productive and _finishes(trees[name], productive, rules):
            productive.add(name)
            pending.extend(users[name])
    return productive


def _finishes(node, productive: set[str], rules) -> bool:
    kind = node[0]
    if kind == "t":
        return True
    if kind == "r":  # a rule the grammar does not define was refused by xgrammar already
        return node[1] in productive or node[1] not in rules
    if kind == "seq":
        return all(_finishes(item, productive, rules) for item in node[1])
    return any(_finishes(item, productive, rules) for item in node[1])


def _references(node):
    if node[0] == "r":
        yield node[1]
    elif node[0] in ("seq", "alt"):
        for item in node[1]:
            yield from _references(item)


class _Parser:
    """A rule's body as a tree: ("alt", [...]), ("seq", [...]), ("r", name) or TERMINAL.

    Only what decides whether the rule can finish is kept: an optional part
    (`*`, `?`, `{0, n}`) and a lookahead always can, as can any terminal."""

    def __init__(self, tokens: list[re.Match]) -> None:
        self.tokens = tokens
        self.i = 0

    def _peek(self) -> str | None:
        if self.i >= len(self.tokens):
            return None
        token = self.tokens[self.i]
        return token["op"] if token.lastgroup == "op" else token.lastgroup

    def alternatives(self):
        options = [self._sequence()]
        while self._peek() == "|":
            self.i += 1
            options.append(self._sequence())
        return ("alt", options)

    def _sequence(self):
        items = []
        while self._peek() not in (None, "|", ")"):
            items.append(self._item())
        return ("seq", items)

    def _item(self):
        token = self.tokens[self.i]
        self.i += 1
        kind = self._peek_kind(token)
        if kind in ("(", "(="):
            node = self.alternatives()
            self.i += self._peek() == ")"
            node = TERMINAL if kind == "(=" else node
        else:
            node = ("r", token["name"]) if kind == "name" else TERMINAL
        while self._peek() in ("*", "?", "+", "rep"):
            quantifier = self.tokens[self.i]
            self.i += 1
            if self._peek_kind(quantifier) in ("*", "?") or (
                    quantifier.lastgroup == "rep" and int(quantifier["lo"]) <= 0):
                node = TERMINAL
        return node

    @staticmethod
    def _peek_kind(token: re.Match) -> str:
        return token["op"] if token.lastgroup == "op" else token.lastgroup
