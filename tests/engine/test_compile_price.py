"""engine/sampling/compile_price.py: a schema's properties, enum values and nesting, and
any grammar's alternations, priced before xgrammar compiles them (issue 57).

Each limit is met exactly (accepted) and passed by one (refused, in words that
say what and the limit). One test compiles the costliest schema every limit
accepts at once against SmolLM2's vocabulary and holds its CPU time to a refused
schema's, compiled in the same run.
"""

from __future__ import annotations

import json
import time

import pytest

from engine.sampling.compile_price import (
    MAX_ALTERNATION_SQUARES, MAX_ALTERNATIVES, MAX_DEPTH, MAX_OPTIONAL_SQUARES, MAX_PROPERTIES,
    MAX_VALUE_SQUARES, MAX_VALUES, Refused, _alternations, price_choices, price_schema,
)
from engine.sampling.grammar_checks import _RULE, _TOKEN, check_grammar

xgrammar = pytest.importorskip("xgrammar")


def nested(depth: int, leaf: dict | None = None) -> dict:
    """`depth` schemas, each the one property of the one around it."""
    schema = leaf or {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def obj(count: int, required: bool = False, prefix: str = "f") -> dict:
    names = [f"{prefix}{i}" for i in range(count)]
    schema = {"type": "object", "properties": {name: {"type": "string"} for name in names}}
    if required:
        schema["required"] = names
    return schema


def objects(total: int, per: int = 256) -> dict:
    """`total` required properties over objects of `per` (the outer one's few optional)."""
    inner = [obj(min(per, total - start), True, f"o{start}_") for start in range(0, total, per)]
    return {"type": "object", "properties": {f"o{i}": o for i, o in enumerate(inner)},
            "required": [f"o{i}" for i in range(len(inner))]}


def enum_of(length: int, count: int, tag: str = "") -> dict:
    """`count` string values whose JSON texts are `length` characters each, all but
    their first 6 or 7 characters the same (shared text costs most)."""
    return {"enum": [f"{tag}{i:06d}".ljust(length - 2, "x") for i in range(count)]}


def refused(schema) -> str:
    with pytest.raises(Refused) as caught:
        price_schema(schema)
    return str(caught.value)


def test_nesting_to_the_limit_is_accepted_and_one_deeper_is_not():
    price_schema(nested(MAX_DEPTH))
    price_schema({"anyOf": [nested(MAX_DEPTH - 1), {"type": "null"}]})
    says = refused(nested(MAX_DEPTH + 1))
    assert f"nests {MAX_DEPTH + 1} levels deep" in says and f"limit of {MAX_DEPTH}" in says
    assert f"{MAX_DEPTH + 1} levels" in refused({"items": nested(MAX_DEPTH)})
    assert "401 levels" in refused(nested(401))  # the whole depth, the pointer cut short
    assert len(refused(nested(401))) < 400


def test_properties_over_the_whole_schema_are_counted():
    price_schema(objects(MAX_PROPERTIES - 4))  # with the 4 outer ones: the limit
    says = refused(objects(MAX_PROPERTIES - 3))
    assert f"{MAX_PROPERTIES + 1} object properties in all" in says
    assert f"limit of {MAX_PROPERTIES}" in says
    # Inside $defs and anyOf branches too: each is compiled.
    spread = {"$defs": {"d": obj(MAX_PROPERTIES // 2, True)},
              "anyOf": [obj(MAX_PROPERTIES // 2, True, "b"), {"$ref": "#/$defs/d"}]}
    price_schema(spread)
    spread["anyOf"][0] = obj(MAX_PROPERTIES // 2 + 1, True, "b")
    assert "object properties in all" in refused(spread)


def test_optional_properties_cost_their_square_per_object():
    widest = int(MAX_OPTIONAL_SQUARES ** 0.5)  # 256
    price_schema(obj(widest))
    says = refused({"type": "object", "properties": {"w": obj(widest + 1)}})
    assert f"has {widest + 1}" in says and "#/properties/w" in says
    assert f"limit of {MAX_OPTIONAL_SQUARES}" in says
    # Two objects of 181 fit (65,522); one more optional property in one (65,885) does not.
    half = int((MAX_OPTIONAL_SQUARES // 2) ** 0.5)
    two = {"type": "object", "properties": {"a": obj(half), "b": obj(half, prefix="g")},
           "required": ["a", "b"]}
    price_schema(two)
    two["properties"]["b"] = obj(half + 1, prefix="g")
    assert "optional properties" in refused(two)
    # Required properties are cheap: the same width, all required, is accepted.
    price_schema(obj(widest + 100, required=True))


def test_one_enum_or_choice_of_branches_holds_at_most_the_limit():
    price_schema({"enum": list(range(MAX_ALTERNATIVES))})
    says = refused({"properties": {"x": {"enum": list(range(MAX_ALTERNATIVES + 1))}}})
    assert f"#/properties/x/enum has {MAX_ALTERNATIVES + 1} values" in says
    assert f"limit of {MAX_ALTERNATIVES}" in says
    for key in ("anyOf", "oneOf"):
        price_schema({key: [{"const": i} for i in range(MAX_ALTERNATIVES)]})
        says = refused({key: [{"const": i} for i in range(MAX_ALTERNATIVES + 1)]})
        assert f"the {key} at #/{key} has {MAX_ALTERNATIVES + 1} branches" in says


def test_enum_and_const_values_over_the_whole_schema_are_counted():
    per = MAX_VALUES // MAX_ALTERNATIVES
    schema = {"properties": {f"p{j}": {"enum": list(range(MAX_ALTERNATIVES))}
                             for j in range(per)}}
    price_schema(schema)
    schema["properties"]["c"] = {"const": 1}
    says = refused(schema)
    assert f"{MAX_VALUES + 1} enum and const values in all" in says
    assert f"limit of {MAX_VALUES}" in says
    # Data that is never compiled is not counted.
    price_schema({"enum": [1], "default": list(range(MAX_VALUES)),
                  "examples": list(range(MAX_VALUES))})


def test_long_enum_values_cost_their_length_squared():
    price_schema(enum_of(1024, MAX_VALUE_SQUARES // 1024 ** 2))  # 4 of 1,024: the limit
    says = refused(enum_of(1025, MAX_VALUE_SQUARES // 1024 ** 2))
    assert "too long to compile" in says and f"limit of {MAX_VALUE_SQUARES}" in says
    price_schema(enum_of(64, MAX_VALUE_SQUARES // 64 ** 2))
    assert "too long" in refused(enum_of(64, MAX_VALUE_SQUARES // 64 ** 2 + 1))
    # anyOf of consts is the same alternation.
    assert "too long" in refused({"anyOf": [{"const": v} for v in enum_of(1025, 4)["enum"]]})


def test_choices_are_priced_as_an_enum():
    price_choices([str(i) for i in range(MAX_ALTERNATIVES)])
    with pytest.raises(Refused, match=f"{MAX_ALTERNATIVES + 1} choices"):
        price_choices([str(i) for i in range(MAX_ALTERNATIVES + 1)])
    side = int((MAX_VALUE_SQUARES // 2) ** 0.5)  # two choices of 1,448 characters
    price_choices(["a" * side, "b" * side])
    with pytest.raises(Refused, match="too long"):
        price_choices(["a" * (side + 1), "b" * (side + 1)])


def ebnf(*alternatives: str) -> str:
    return str(xgrammar.Grammar.from_ebnf(
        "root ::= " + " | ".join(json.dumps(a) for a in alternatives)))


def test_any_grammar_is_held_to_the_alternation_limits():
    check_grammar(ebnf(*(f"a{i}" for i in range(MAX_ALTERNATIVES))))
    with pytest.raises(Refused, match=f"alternation of {MAX_ALTERNATIVES + 1} alternatives"):
        check_grammar(ebnf(*(f"a{i}" for i in range(MAX_ALTERNATIVES + 1))))
    side = int((MAX_ALTERNATION_SQUARES // 2) ** 0.5)
    check_grammar(ebnf("a" + "x" * (side - 1), "b" + "x" * (side - 1)))
    with pytest.raises(Refused, match="too long to compile"):
        check_grammar(ebnf("a" + "x" * side, "b" + "x" * side))
    # A regex's alternation reaches the same rule (its literals a character each).
    long = "x" * side
    with pytest.raises(Refused, match="too long to compile"):
        check_grammar(str(xgrammar.Grammar.from_regex(f"(a{long}|b{long})")))
    # One long literal, with nothing to choose between, is cheap and accepted.
    check_grammar(ebnf("x" * 10 * side))


def alternations(text: str) -> list[tuple[int, int]]:
    """Each alternation of a grammar's root rule: (alternatives, characters squared, summed)."""
    (line,) = [line for line in text.splitlines() if line.startswith("root ::= ")]
    tokens = [m for m in _TOKEN.finditer(line, _RULE.match(line).end()) if m.lastgroup]
    return list(_alternations(tokens))


def test_alternations_are_counted_per_group_and_literal_characters_per_alternative():
    assert alternations(ebnf("ab", "cd", "efg")) == [(3, 2 * 2 + 2 * 2 + 3 * 3)]
    # A nested group's literals count in the alternative around it; a class is one.
    assert sorted(alternations('root ::= "ab" ("c" | "de") | [x-z] "f"')) == [
        (2, 1 + 4), (2, 5 * 5 + 2 * 2)]


def test_the_costliest_schema_every_limit_accepts_compiles_faster_than_a_refused_one(
        smollm2_path):
    """Every limit met at once, the content at the deepest level allowed (nesting
    multiplies the conversion's cost), the enums' values sharing their text, against
    a yardstick compiled in the same run: one object of 800 optional properties,
    which the limits refuse (the attack's 2,500 took two minutes). Measured 1.2 s
    against the yardstick's 1.9 s on one machine, 1.65-1.95 s against 2.0-2.3 s
    on another (a CI run failed a 2 s bound there): CPU seconds alone say more
    about the machine than about the limits; 1.11-1.18 yardsticks on a third
    (2026-12-01). Twice the depth allowed measured 1.53 yardsticks, over the 1.35
    held here."""
    import xgrammar
    from transformers import AutoTokenizer

    from engine.sampling.structured_outputs import StructuredOutputs, StructuredOutputsParams

    widest = int((MAX_OPTIONAL_SQUARES // 2) ** 0.5)  # two objects of 181
    per_enum = MAX_VALUES // 2 - 6
    length = int((MAX_VALUE_SQUARES / (2 * per_enum)) ** 0.5)  # sharing all but 6 characters
    content = {"type": "object", "properties": {
        "w1": obj(widest), "w2": obj(widest - 1, prefix="g"),
        **{f"e{j}": enum_of(length, per_enum, str(j)) for j in range(2)}}}
    chain = MAX_DEPTH - 3  # wrappers around `content`: w1's properties at MAX_DEPTH
    left = MAX_PROPERTIES - chain - 9 - (2 * widest - 1)
    content["properties"].update({f"r{j}": obj(left // 5, True, f"r{j}_") for j in range(5)})
    schema = nested(chain + 1, content)
    price_schema(schema)  # accepted, every limit nearly met
    assert "levels deep" in refused({"items": schema})
    yardstick = obj(800)
    assert "optional properties" in refused(yardstick)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    # Alternated rounds, the least of each side compared: one pair timed once
    # measured 1.37 and 1.79 yardsticks in two CI runs (a neighbour's load lands on
    # one side of the pair); the least of three measured 1.11-1.18, loaded or idle.
    took, yardstick_took = [], []
    for _ in range(3):
        compiler = StructuredOutputs(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
        compiler.compiler()  # the vocabulary's preparation is not the schema's cost
        took.append(cpu_seconds(lambda: compiler.compile(StructuredOutputsParams(json=schema))))
        # Straight to xgrammar, uncached: our checks would refuse it.
        yardstick_took.append(cpu_seconds(lambda: compiler.compiler(cached=False).compile_grammar(
            xgrammar.Grammar.from_json_schema(json.dumps(yardstick), any_whitespace=False))))
    took, yardstick_took = min(took), min(yardstick_took)
    assert took < 1.35 * yardstick_took, (
        f"the costliest accepted schema took {took:.2f} s of CPU to compile, "
        f"800 optional properties {yardstick_took:.2f} s")


def cpu_seconds(work) -> float:
    """The calling thread's CPU seconds for `work()` (xgrammar compiles on it:
    the compilers run with max_threads=1)."""
    started = time.thread_time()
    work()
    return time.thread_time() - started
