"""engine/sampling/grammar_checks.py: a constraint priced and read before xgrammar compiles it.

No tokenizer: the checks read the schema, the regex and xgrammar's normalised
EBNF, which needs only xgrammar's parser.
"""

from __future__ import annotations

import json

import pytest

from engine.sampling.grammar_checks import (
    MAX_NESTED_REPEAT, MAX_PATTERN_SIZE, REPEAT_BUDGET, Refused, check_grammar, check_pattern,
    check_schema, regex_cost,
)

xgrammar = pytest.importorskip("xgrammar")


@pytest.mark.parametrize("pattern, size, nested", [
    ("^[0-9]{1,160}$", 162, 0),
    ("^[a-z]{1,4400}$", 4402, 0),
    (r"^(\d{1,3}\.){3}\d{1,3}$", 17, 9),
    ("^(.{1,10}){1,10}$", 102, 100),
    ("^(.?){1,30}$", 32, 60),
    ("^[a-z]+?$", 3, 0),  # a lazy quantifier is not a second repetition
    (".{1,10}?", 10, 0),
    ("(?:ab|c){2}", 6, 0),  # a group's modifier is no atom
    ("(?<year>[0-9]{4})-x", 6, 0),
    (r"[\]{}a]{3}", 3, 0),  # braces inside a class are members
    (r"\p{L}{5}", 5, 0),
    ("a{,5}b{2,}", 7, 0),
    ("a{x}", 4, 0),  # not a quantifier: characters
    ("((a{1,9}){1,9}", 81, 81),  # unclosed: still priced
])
def test_regex_cost(pattern, size, nested):
    assert regex_cost(pattern) == (size, nested)


def test_patterns_over_the_limits_are_refused():
    assert check_pattern(r"^(\d{1,3}\.){3}\d{1,3}$", "#/pattern") == 17
    with pytest.raises(Refused, match="expands to"):
        check_pattern("a" * (MAX_PATTERN_SIZE + 1), "#/pattern")
    with pytest.raises(Refused, match="nests repetitions"):
        check_pattern("(a{1,%d}){1,2}" % MAX_NESTED_REPEAT, "#/pattern")


@pytest.mark.parametrize("schema, says", [
    ({"properties": {"a": {"pattern": "^[a-z]{1,4400}$"}}}, "#/properties/a/pattern expands"),
    ({"properties": {"enum": {"pattern": "(.?){1,100}"}}}, "nests"),  # a property named enum
    ({"patternProperties": {"(.{1,9}){1,9}": {}}}, "nests"),
    ({"items": [{"pattern": "[a-z]{900}"}, {"pattern": "[a-z]{900}"}, {"pattern": "[a-z]{900}"}]},
     "in all"),
    ({"$ref": "https://example.com/s.json"}, "never fetched"),
    ({"$ref": "schema.json#/a"}, "never fetched"),
    ({"$ref": "#anchor"}, "never fetched"),
    ({"$ref": "#/$defs/missing"}, "does not resolve"),
    ({"items": {"$ref": "#/items/3"}}, "does not resolve"),
])
def test_schemas_refused(schema, says):
    with pytest.raises(Refused, match=says):
        check_schema(schema)


def test_schemas_accepted():
    check_schema({"$defs": {"a b/c~": {"type": "integer"}}, "$ref": "#/$defs/a%20b~1c~0"})
    check_schema({"prefixItems": [{"type": "integer"}], "items": {"$ref": "#/prefixItems/0"}})
    check_schema({"const": {"$ref": "http://x"}, "enum": [{"pattern": "(.?){1,100}"}],
                  "default": {"$ref": "nowhere"}})  # data, not schemas
    check_schema(True)
    # $ref chains that reach content, and a $ref to the root from inside it
    check_schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "integer"}}, "$ref": "#/$defs/a"})
    check_schema({"$defs": {"a": {"$ref": "#/$defs/a", "type": "string"}}, "$ref": "#/$defs/a"})
    check_schema({"type": "object", "properties": {"c": {"$ref": "#"}}})


def normalised(kind: str, source) -> str:
    if kind == "schema":
        return str(xgrammar.Grammar.from_json_schema(json.dumps(source), any_whitespace=False))
    if kind == "regex":
        return str(xgrammar.Grammar.from_regex(source))
    return str(xgrammar.Grammar.from_ebnf(source))


@pytest.mark.parametrize("kind, source", [
    ("ebnf", "root ::= root"),
    ("ebnf", 'root ::= "a" root'),
    ("ebnf", "root ::= a\na ::= b\nb ::= a"),
    ("ebnf", 'root ::= ("x" root)+'),
    ("schema", {"$ref": "#"}),
    ("schema", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a"}),
    ("schema", {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]}),
])
def test_a_grammar_that_accepts_nothing_is_refused(kind, source):
    with pytest.raises(Refused, match="no output"):
        if kind == "schema":
            check_schema(source)  # as the engine does, before xgrammar converts it
        check_grammar(normalised(kind, source))


@pytest.mark.parametrize("kind, source", [
    ("ebnf", 'root ::= a\na ::= b\nb ::= a | "x"'),
    ("ebnf", 'root ::= ("x" root)* "y"'),
    ("ebnf", 'root ::= a "b"\na ::= "a" (=("b"))'),
    ("ebnf", 'root ::= [a-z]{0,100} "(" ")" "|"'),
    ("schema", {"type": "object", "properties": {"c": {"$ref": "#"}}}),
    ("schema", {"type": "array", "items": {"$ref": "#"}}),
    ("schema", {"type": "object"}),
    ("schema", {"type": "string", "pattern": "^[0-9]{1,160}$"}),
    ("regex", "(19|20)[0-9]{2}"),
])
def test_grammars_that_can_finish_are_accepted(kind, source):
    check_grammar(normalised(kind, source))


def test_repeated_character_classes_are_priced_once_per_distinct_bound():
    same = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "maxLength": 1000} for i in range(20)}}
    check_grammar(normalised("schema", same))  # one bound: 150 units
    distinct = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "maxLength": 100 + i} for i in range(10)}}
    with pytest.raises(Refused, match=f"budget of {REPEAT_BUDGET}"):
        check_grammar(normalised("schema", distinct))
    # Repeating anything but one character class is cheap, and not priced.
    check_grammar(normalised("schema", {"type": "array", "maxItems": 100_000}))
    check_grammar(normalised("regex", "(ab|cd){0,100000}"))
    with pytest.raises(Refused, match="budget"):
        check_grammar(normalised("ebnf", " ".join(
            ["root ::="] + [f"[a-z]{{0,{200 + i}}}" for i in range(7)])))
