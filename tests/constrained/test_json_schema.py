"""prepare_json_schema / validate_json_output: normalisations keep the meaning, refusals name
keyword and path, lenient mode drops, outputs are validated; and the xgrammar 0.2.9 behaviour
the lowering (`json_schema.lower`) relies on, measured with GrammarMatcher.accept_string."""

from __future__ import annotations

import functools
import json
import random
import time

import pytest
import xgrammar as xgr
from jsonschema import validators
from xgrammar.testing import _is_grammar_accept_string

from arborlm.constrained.base import GrammarError
from arborlm.constrained.json_schema import (
    PreparedSchema,
    prepare_json_schema,
    validate_json_output,
)

D4 = "http://json-schema.org/draft-04/schema#"
D7 = "http://json-schema.org/draft-07/schema#"
INT = {"type": "integer"}
STR = {"type": "string"}


def obj(props: dict, **kw) -> dict:
    return {"type": "object", "properties": props, **kw}


# ---------------------------------------------------------------------------
# helpers


def original_valid(prepared: PreparedSchema, instance) -> bool:
    cls = validators.validator_for({"$schema": prepared.dialect})
    return cls(json.loads(prepared.original)).is_valid(instance)


def normalised_valid(prepared: PreparedSchema, instance) -> bool:
    return validators.Draft202012Validator(json.loads(prepared.text)).is_valid(instance)


VOCAB = [chr(i) for i in range(32, 127)] + ["\u00e9", "</s>"]
STOP = len(VOCAB) - 1
CLOSING = set('"]}')


@functools.lru_cache(maxsize=1)
def _walk_compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[STOP]), cache_enabled=False)


def grammar_walks(text: str, count: int, seed: int = 0, max_steps: int = 400) -> list[str]:
    """Finished random outputs of the grammar xgrammar compiles from schema ``text``.

    One character per token; closing characters get likelier as a walk grows,
    so most walks finish. Compiled as the xgrammar backend does (one line,
    strict mode).
    """
    compiled = _walk_compiler().compile_json_schema(text, any_whitespace=False, strict_mode=True)
    rng = random.Random(seed)
    bitmask = xgr.allocate_token_bitmask(1, len(VOCAB))
    outputs = []
    for _ in range(count):
        matcher = xgr.GrammarMatcher(compiled)
        chars: list[str] = []
        for step in range(max_steps):
            if matcher.is_terminated():
                outputs.append("".join(chars))
                break
            matcher.fill_next_token_bitmask(bitmask)
            allowed = xgr.testing.bitmask_to_bool_mask(bitmask, len(VOCAB))[0].nonzero().flatten().tolist()
            if STOP in allowed:
                token = STOP
            else:
                pull = 1 + 50 * step / max_steps
                weights = [8 * pull if VOCAB[t] in CLOSING else 1 for t in allowed]
                token = rng.choices(allowed, weights=weights)[0]
            assert matcher.accept_token(token)
            if token != STOP:
                chars.append(VOCAB[token])
    return outputs


def assert_walks_valid(prepared: PreparedSchema, count: int = 6, **kw) -> None:
    """Every finished random output of the grammar satisfies the original schema.

    Duplicate object keys are skipped: no grammar can forbid them, and the
    final validation rejects them (see the `json_schema` package docstring).
    """
    for text in grammar_walks(prepared.text, count, **kw):
        message = validate_json_output(prepared, text)
        assert message is None or "duplicate key" in message, (text, message, prepared.text)


def xgrammar_accepts(schema, text: str) -> bool:
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    return _is_grammar_accept_string(grammar, text)


# ---------------------------------------------------------------------------
# Normalisations that keep the meaning: (id, schema, instances). The normalised
# schema must agree with the original on every instance, and every output of its
# grammar must satisfy the original.

ADDRESS = {
    "type": "object",
    "properties": {"street": STR, "extended": STR, "box": STR},
    "additionalProperties": False,
    "dependencies": {"extended": ["street"], "box": ["street"]},
}
WP_CONFIG = {  # WashingtonPost: arbitrary keys except three names, via `not: {}`
    "type": "object",
    "additionalProperties": False,
    "patternProperties": {"^([a-zA-Z0-9_])*$": {}},
    "properties": {"referent": {"not": {}}, "type": {"not": {}}, "version": {"not": {}}},
}
TREE = {
    "$defs": {"node": obj({"value": INT, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                          required=["value"])},
    "$ref": "#/$defs/node",
}
EXACT = [
    ("allOf objects", {"allOf": [obj({"a": INT}, required=["a"]), obj({"b": STR}, required=["b"])]},
     [{"a": 1, "b": "x"}, {"a": 1}, {"b": "x"}, {"a": "x", "b": "x"}, 3]),
    ("allOf ref and properties", {
        "definitions": {"ref": obj({"referent": obj({"type": STR, "id": STR}, required=["id"])}, required=["referent"])},
        "allOf": [{"$ref": "#/definitions/ref"}, {"properties": {"referent": {"properties": {"type": {"enum": ["site"]}}}}}],
    }, [{"referent": {"id": "a", "type": "site"}}, {"referent": {"id": "a", "type": "x"}}, {"referent": {"id": "a"}},
        {"referent": {"type": "site"}}, {}]),
    ("allOf tightens bounds", {"allOf": [{"type": "number", "minimum": 1}, {"type": "integer", "exclusiveMaximum": 10}]},
     [1, 9, 10, 0, 2.5, "a"]),
    ("ref siblings 2020", {"$defs": {"a": INT}, "$ref": "#/$defs/a", "minimum": 5}, [5, 4, "a"]),
    ("ref siblings ignored in draft 7", {"$schema": D7, "definitions": {"a": INT}, "$ref": "#/definitions/a", "minimum": 5},
     [5, 4, "a"]),
    ("recursive ref", TREE, [{"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]},
                             {"value": 1, "children": [{"children": []}]}, {"value": 1, "children": [{"value": "x"}]}]),
    ("recursive ref to root", obj({"v": INT, "c": {"type": "array", "items": {"$ref": "#"}}}, required=["v"]),
     [{"v": 1, "c": [{"v": 2, "c": []}]}, {"v": 1, "c": [{}]}]),
    ("recursive ref merged in allOf", {
        "$defs": {"n": obj({"v": INT, "next": {"allOf": [{"$ref": "#/$defs/n"}, {"required": ["v"]}]}})},
        "$ref": "#/$defs/n",
    }, [{"v": 1, "next": {"v": 2, "next": {"v": 3}}}, {"v": 1, "next": {"next": {"v": 3}}}, {"next": {"v": 1}}]),
    ("ref by anchor and $id", {"$defs": {"a": {"$anchor": "num", "type": "integer"},
                                         "b": {"$id": "http://example.com/s.json", "type": "string"}},
                               "type": "array", "prefixItems": [{"$ref": "#num"}, {"$ref": "http://example.com/s.json"}]},
     [[1, "a"], ["a", "a"], [1, 1]]),
    ("anyOf siblings distributed", {"type": "object", "properties": {"k": INT}, "required": ["k"],
                                    "anyOf": [obj({"a": INT}, required=["a"]), obj({"b": STR}, required=["b"])]},
     [{"k": 1, "a": 1}, {"k": 1, "b": "x"}, {"a": 1}, {"k": 1}, {"k": 1, "b": 2}]),
    ("anyOf type sibling", {"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": 0}]}, [5, 0, 3, "a"]),
    ("oneOf siblings distributed", {"type": "object", "properties": {"k": INT},
                                    "oneOf": [{"required": ["k"]}, {"required": ["j"]}]},
     [{"k": 1}, {"j": 1}, {"k": 1, "j": 1}, {}]),
    ("enum filtered by siblings", {"type": "string", "enum": ["a", "bb", 1, None], "minLength": 2}, ["bb", "a", 1, None]),
    ("const", {"const": {"a": [1, 2]}}, [{"a": [1, 2]}, {"a": [1]}]),
    ("required not in properties", {"type": "object", "required": ["a"], "additionalProperties": INT},
     [{"a": 1}, {}, {"a": "x"}]),
    ("required matching patternProperties", {"type": "object", "required": ["x_a"], "patternProperties": {"^x_": INT}},
     [{"x_a": 1}, {"x_a": "s"}, {}]),
    ("not {} property excluded from pattern", WP_CONFIG, [{"a": 1}, {"type": 1}, {"versions": 1}, {"a-b": 1}]),
    ("not {} property with additionalProperties", obj({"a": INT, "b": {"not": {}}}, additionalProperties=STR),
     [{"a": 1}, {"b": "x"}, {"c": "x"}, {"c": 1}]),
    ("not type", {"not": {"type": "string"}}, [1, None, "a", [1]]),
    ("not required", {"required": ["build"], "not": {"required": ["image"]}},
     [{"build": 1}, {"build": 1, "image": 1}, {"image": 1}, 3]),
    ("dependentRequired", obj({"a": INT, "b": INT}, dependentRequired={"a": ["b"]}), [{"b": 1}, {"a": 1, "b": 2}, {"a": 1}]),
    ("dependencies draft 7 (array)", {"$schema": D7, **ADDRESS},
     [{}, {"street": "s"}, {"extended": "e", "street": "s"}, {"extended": "e"}, {"box": "b"}]),
    ("dependencies draft 7 (schema)", {"$schema": D7, **obj({"website": STR, "kind": STR}, additionalProperties=False,
                                                            dependencies={"website": obj({"kind": {"enum": ["section"]}})})},
     [{"kind": "x"}, {"website": "w", "kind": "section"}, {"website": "w", "kind": "x"}, {"website": "w"}]),
    ("draft 4 exclusive bounds", {"$schema": D4, "type": "number", "minimum": 1, "exclusiveMinimum": True, "maximum": 2},
     [1, 1.5, 2, 2.5]),
    ("draft 4 without $schema", {"type": "integer", "minimum": 1, "exclusiveMinimum": True}, [1, 2]),
    ("items array", {"$schema": D7, "type": "array", "items": [INT, STR], "additionalItems": False},
     [[1, "a"], [1], ["a"], [1, "a", 2]]),
    ("integer fractional bounds", {"type": "integer", "minimum": 1.5, "exclusiveMaximum": 4.5}, [1, 2, 4, 5]),
    ("false item position", {"type": "array", "prefixItems": [INT, False]}, [[], [1], [1, 2]]),
    ("unsearched pattern", {"type": "string", "pattern": "[0-9]"}, ["a1b", "1", "abc"]),
    ("pattern alternatives", {"type": "string", "pattern": "^a|b$"}, ["ax", "xb", "xa", "bx"]),
    ("pattern anchored groups", {"type": "string", "pattern": "(^$)|(^[a-f]{4}$)"}, ["", "abcd", "abcdz", "zabcd"]),
    ("vacuous pattern", {"type": "string", "pattern": "([A-Z]+)?", "maxLength": 2}, ["ab", "abc", ""]),
    ("pattern with lengths folded", {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 3},
     ["ab", "abc", "a", "abcd", "AB"]),
    ("lengths the pattern implies", {"type": "string", "pattern": "^(?:\\S+\\s+){0,3}\\S+$", "minLength": 1},
     ["a b", "", " "]),
    ("optional group pattern", {"type": "string", "pattern": "^(https?://.*)?$"}, ["", "http://x", "abc", "xhttp://"]),
    ("listed property matching a pattern", obj({"xa": {"minimum": 5}}, patternProperties={"^x": INT}),
     [{"xa": 5}, {"xa": 1}, {"xb": 1}, {"xa": "s"}]),
    ("propertyNames with additionalProperties", obj({"a": INT}, additionalProperties=STR,
                                                    propertyNames={"pattern": "^[a-b]*$"}),
     [{"a": 1}, {"a": "x"}, {"ab": "x"}, {"ab": 1}, {"c": "x"}]),
    ("pattern covering every key", obj({"c": {"type": "null"}}, patternProperties={".*": {"type": ["null", "string"]}},
                                       additionalProperties=INT), [{"c": None}, {"k": "x"}, {"k": 1}, {"c": "x"}]),
    ("not {} property with additionalProperties true", obj({"a": {"not": {}}}, additionalProperties=True),
     [{"a": 1}, {"b": 1}, {}]),
    ("dependentSchemas on a required trigger", {"required": ["c"], "dependentSchemas": {"c": False}}, [1, {"c": 1}, {}]),
    ("minProperties without additionalProperties", {"type": "object", "properties": {"a": INT}, "minProperties": 2},
     [{"a": 1, "b": 2}, {"a": 1}]),
    ("maxItems below prefixItems", {"type": "array", "prefixItems": [INT, INT], "maxItems": 1}, [[], [1], [1, 2]]),
    ("unevaluatedProperties", obj({"a": INT}, unevaluatedProperties=STR), [{"a": 1, "b": "x"}, {"a": 1, "b": 2}]),
    ("propertyNames excludes a property", obj({"a": INT, "Bad": INT}, propertyNames={"pattern": "^[a-z]+$"},
                                               additionalProperties=INT), [{"a": 1}, {"Bad": 1}, {"bb": 1}, {"B": 1}]),
    ("annotations dropped", {"type": "string", "title": "t", "description": "d", "default": "x", "examples": ["y"],
                             "$comment": "c", "deprecated": True, "readOnly": True, "writeOnly": False,
                             "x-custom": 1}, ["a", 1]),
    ("number with integral multipleOf", {"type": "number", "multipleOf": 2}, [4, 4.0, 3, 2.5]),
    ("format is an annotation", {"type": "string", "format": "email"}, ["a@b.co", "nope"]),
]
# Rewrites that narrow: (id, schema, instances valid in both, instances only the original accepts)
NARROWING = [
    ("untyped string keywords", {"minLength": 2}, ["ab"], [1]),
    ("untyped object keywords", {"properties": {"a": INT}, "required": ["a"]}, [{"a": 1}], ["x"]),
    ("integer bounds beyond int64", {"type": "integer", "minimum": -1e30}, [0], [-(2**70)]),
    ("pattern with maxLength capped", {"type": "string", "pattern": "^([a-z]+):([a-z]+)$", "maxLength": 21},
     ["ab:cd"], ["abcdefghijklmnopq:a"]),
]


@pytest.mark.parametrize("name,schema,instances", EXACT, ids=[c[0] for c in EXACT])
def test_normalisation_keeps_meaning(name, schema, instances):
    prepared = prepare_json_schema(schema)
    assert prepared.dropped == ()
    for instance in instances:
        assert normalised_valid(prepared, instance) == original_valid(prepared, instance), (instance, prepared.text)
    assert_walks_valid(prepared)


@pytest.mark.parametrize("name,schema,both,original_only", NARROWING, ids=[c[0] for c in NARROWING])
def test_narrowing_rewrites_stay_inside_the_schema(name, schema, both, original_only):
    prepared = prepare_json_schema(schema)
    for instance in both:
        assert normalised_valid(prepared, instance) and original_valid(prepared, instance)
    for instance in original_only:
        assert original_valid(prepared, instance) and not normalised_valid(prepared, instance)
    assert_walks_valid(prepared)


def test_normalised_text_shape():
    prepared = prepare_json_schema(json.dumps(TREE))
    text = json.loads(prepared.text)
    assert prepared.text == json.dumps(text)
    assert text["$ref"].startswith("#/$defs/")  # recursion stays a reference
    assert prepared.original == json.dumps(TREE, sort_keys=True)
    annotated = prepare_json_schema({"type": "string", "title": "t", "description": "d", "format": "date"})
    assert json.loads(annotated.text) == {"type": "string", "format": "date"}
    ordered = prepare_json_schema({"type": "object", "properties": {"reasoning": {"type": "string"},
                                                                      "answer": {"type": "integer"}}})
    assert list(json.loads(ordered.text)["properties"]) == ["reasoning", "answer"]  # generation order kept
    assert json.loads(prepare_json_schema(True).text) == {}
    hash(prepared)  # frozen and hashable


def test_enum_dedup_is_json_equality():
    # 1 and 1.0 are one JSON value, true and 1 are not; objects compare regardless of key order
    prepared = prepare_json_schema({"enum": [1, 1.0, True, 0, False, 0.0, None, "1", [1], [1.0], [True],
                                             {"a": 1, "b": [2]}, {"b": [2.0], "a": 1}, 2**53 + 1, 2.0**53]})
    assert json.loads(prepared.text)["enum"] == [1, True, 0, False, None, "1", [1], [True], {"a": 1, "b": [2]},
                                                 2**53 + 1, 2.0**53]
    both = prepare_json_schema({"allOf": [{"enum": [1, True, "x", {"k": 1}]}, {"enum": [1.0, {"k": 1.0}, "y"]}]})
    assert json.loads(both.text)["enum"] == [1, {"k": 1}]
    assert json.loads(prepare_json_schema({"enum": [True, 1], "const": 1.0}).text)["enum"] == [1.0]


def test_huge_enum_prepares_in_linear_time():
    # was quadratic: 20000 values took minutes, on the server's event loop
    values = [f"value-{i}" for i in range(20000)]
    start = time.perf_counter()
    prepared = prepare_json_schema({"type": "string", "enum": values + values[:100]})
    assert time.perf_counter() - start < 5
    assert json.loads(prepared.text)["enum"] == values


def test_format_beside_pattern_is_dropped():
    # xgrammar enforces the format and ignores the pattern when both are given
    prepared = prepare_json_schema({"type": "string", "format": "email", "pattern": "^[a-z]+@x\\.org$"})
    assert "format" not in json.loads(prepared.text)


# ---------------------------------------------------------------------------
# Refusals: (schema, keyword, path) — the message names "keyword at path";
# lenient mode lists the same string in `dropped` and compiles.

REFUSED = [
    ({"type": "integer", "not": {"multipleOf": 3}}, "not", "/"),  # (not of const / enum: `conditionals`)
    (obj({"a": {"if": {"minimum": 0}, "then": {"maximum": 5}}}), "if", "/properties/a"),
    (obj({"tags": {"type": "array", "items": STR, "uniqueItems": True}}), "uniqueItems", "/properties/tags"),
    ({"type": "array", "contains": {"const": 5}}, "contains", "/"),
    ({"type": "array", "contains": {"const": 5}, "maxContains": 1}, "contains", "/"),
    (obj({"price": {"type": "number", "multipleOf": 0.01}}), "multipleOf", "/properties/price"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0}, "multipleOf", "/"),
    ({"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]+$"}, "pattern", "/"),
    ({"type": "string", "pattern": "^(a)\\1$"}, "pattern", "/"),
    ({"type": "string", "pattern": "^(?:\\S+\\s+){0,29}\\S+$", "maxLength": 100}, "maxLength", "/"),
    ({"type": "string", "pattern": "^[a-z]+[0-9]+$", "minLength": 4}, "minLength", "/"),
    ({"allOf": [{"pattern": "^a"}, {"pattern": "b$"}]}, "pattern", "/"),
    ({"type": "object", "patternProperties": {".*": INT, "^id$": {"minimum": 5}}}, "patternProperties", "/"),
    ({"type": "object", "patternProperties": {"^x": INT}, "propertyNames": {"maxLength": 3}}, "propertyNames", "/"),
    (obj({"a": INT}, anyOf=[{"required": ["a"]}], unevaluatedProperties=False), "unevaluatedProperties", "/"),
    # A nested $id opens a second schema resource: the dynamic scope matters (one resource: a $ref).
    ({"$defs": {"a": {"$id": "https://example.com/a", "$dynamicAnchor": "a"}}, "$dynamicRef": "#a"},
     "$dynamicRef", "/"),
    ({"type": "object", "patternProperties": {"^x": INT}, "additionalProperties": STR}, "additionalProperties", "/"),
    (obj({"ab": INT}, patternProperties={"a|b": STR}), "patternProperties", "/patternProperties/a|b"),
]


@pytest.mark.parametrize("schema,keyword,path", REFUSED, ids=[f"{k}@{p}#{i}" for i, (_, k, p) in enumerate(REFUSED)])
def test_refused_keyword_is_named_with_its_path(schema, keyword, path):
    with pytest.raises(GrammarError) as info:
        prepare_json_schema(schema)
    assert info.value.param == "json_schema"
    assert f"{keyword} at {path}" in info.value.message
    assert "json_schema_lenient" in info.value.message
    lenient = prepare_json_schema(schema, lenient=True)
    assert f"{keyword} at {path}" in lenient.dropped
    xgr.Grammar.from_json_schema(lenient.text, any_whitespace=False, strict_mode=True)


def test_refusal_lists_every_keyword():
    schema = obj({"a": {"not": {"enum": [[1]]}}, "b": {"type": "array", "uniqueItems": True}})
    with pytest.raises(GrammarError) as info:
        prepare_json_schema(schema)
    assert "not at /properties/a" in info.value.message and "uniqueItems at /properties/b" in info.value.message
    assert prepare_json_schema(schema, lenient=True).dropped == ("not at /properties/a", "uniqueItems at /properties/b")


def test_oneof_is_accepted_and_left_to_validation():
    prepared = prepare_json_schema({"oneOf": [{"type": "integer"}, {"type": "number"}]})
    assert prepared.dropped == ()
    assert validate_json_output(prepared, "1.5") is None
    assert "at /" in validate_json_output(prepared, "1")  # both branches match


# ---------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("schema,needle", [
    ('{"type": "object",', "not valid JSON: Expecting property name enclosed in double quotes at line 1 column 19"),
    ('{"minimum": NaN}', "not valid JSON"),
    ("[1, 2]", "must be a JSON object or a boolean, got list"),
    ('"string"', "must be a JSON object or a boolean, got str"),
    ({"type": 5}, "not a valid JSON Schema (draft 2020-12)"),
    ({"properties": {"a": {"minimum": "zero"}}}, "at /properties/a/minimum"),
    ({"type": "string", "pattern": "(unclosed"}, "not a valid JSON Schema"),
    ({"$ref": "#/$defs/missing"}, "$ref '#/$defs/missing' at / cannot be resolved"),
    (obj({"a": {"$ref": "#nowhere"}}), "at /properties/a cannot be resolved"),
    ({"$ref": "http://json-schema.org/draft-07/schema#"}, "cannot be resolved"),
    (False, "accepts no value"),
    ({"type": "string", "enum": [1, 2]}, "accepts no value"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "accepts no value"),
])
def test_bad_schemas_raise_grammar_error(schema, needle):
    with pytest.raises(GrammarError) as info:
        prepare_json_schema(schema, lenient=True)
    assert info.value.param == "json_schema"
    assert needle in info.value.message


# ---------------------------------------------------------------------------
# validate_json_output


PERSON = prepare_json_schema(obj({"name": STR, "age": {"type": "integer", "minimum": 0},
                                  "email": {"type": "string", "format": "email"}}, required=["name"]))


@pytest.mark.parametrize("text,needle", [
    ('{"name": "Ann", "age": 3}', None),
    ('  {"name": "Ann", "email": "not an email"}\n', None),  # format is an annotation
    ('{"name": "Ann", "age": -1}', "at /age: -1 is less than the minimum of 0"),
    ('{"age": 1}', "'name' is a required property"),
    ('{"name": "Ann"', "output is not valid JSON"),
    ('{"name": "Ann"} x', "output is not valid JSON"),
    ('{"name": "Ann", "name": "Bob"}', "duplicate key 'name'"),
    ('{"name": "Ann", "age": NaN}', "NaN is not JSON"),
])
def test_validate_json_output(text, needle):
    message = validate_json_output(PERSON, text)
    if needle is None:
        assert message is None
    else:
        assert needle in message


def test_validate_uses_the_schema_dialect():
    draft4 = prepare_json_schema({"$schema": D4, "type": "number", "maximum": 2, "exclusiveMaximum": True})
    assert validate_json_output(draft4, "1.5") is None
    assert validate_json_output(draft4, "2") is not None


# ---------------------------------------------------------------------------
# What xgrammar 0.2.9 does (the table in `json_schema.lower`'s docstring): (schema, text, accepted).
# A change here means xgrammar changed and the lowering's refusals and
# rewrites should be revisited.

XGRAMMAR_FACTS = [
    ({"type": "integer", "not": {"const": 3}}, "3", True),  # not: ignored
    ({"type": "array", "items": INT, "uniqueItems": True}, "[1, 1]", True),  # uniqueItems: ignored
    ({"type": "array", "items": INT, "contains": {"const": 5}}, "[1]", True),  # contains: ignored
    (obj({"a": INT, "b": INT}, dependentRequired={"a": ["b"]}), '{"a": 1}', True),  # ignored
    (obj({"a": INT, "b": STR}, **{"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}),
     '{"a": 1}', True),  # if/then: ignored
    ({"allOf": [INT, {"minimum": 3}]}, '"a"', True),  # several allOf branches: any value
    ({"$defs": {"a": INT}, "$ref": "#/$defs/a", "minimum": 5}, "4", True),  # $ref siblings: ignored
    ({"$defs": {"a": {"$anchor": "n", "type": "integer"}}, "$ref": "#n"}, '"a"', True),  # anchors: any value
    ({"type": "string", "enum": ["a", 1]}, "1", True),  # enum ignores its siblings
    ({"type": "object", "required": ["a"]}, "{}", True),  # required outside properties: ignored
    ({"type": "object", "properties": {"k": INT}, "required": ["k"], "anyOf": [obj({"a": INT}, required=["a"])]},
     '{"a": 1}', True),  # keywords beside anyOf: ignored
    ({"minLength": 2}, '"a"', True),  # string keywords without a type: ignored
    ({"type": "number", "multipleOf": 0.5}, "1.25", True),  # multipleOf on numbers: ignored
    ({"type": "integer", "multipleOf": 2, "minimum": 0}, "3", True),  # multipleOf with one bound: ignored
    ({"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 100}, "3", False),  # enforced
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, '"ab"', True),  # lengths beside a pattern: ignored
    ({"type": "string", "pattern": "^[a-z]+$", "format": "email"}, '"A@b.co"', True),  # pattern beside format: ignored
    ({"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]+$"}, '"ab"', True),  # lookahead: ignored
    ({"type": "string", "pattern": "[0-9]"}, '"a1b"', False),  # patterns match the whole string
    ({"type": "object", "patternProperties": {".*": INT, "^xy$": {"minimum": 5}}, "additionalProperties": False},
     '{"xy": 1}', True),  # a key matching two patterns gets one schema
    ({"type": "array", "maxItems": 3}, "[1]", False),  # no items: only []
    ({"oneOf": [INT, {"type": "number"}]}, "1", True),  # oneOf is anyOf
    (obj({"a": INT}), '{"a": 1, "b": 2}', False),  # strict mode: no unlisted properties
    ({"type": "string", "format": "date"}, '"nope"', False),  # known formats are enforced
    ({"type": "string", "pattern": "^(a.*)?$"}, '"b"', True),  # an optional group is mis-compiled
    ({"type": "string", "pattern": "^(a.*){0,1}$"}, '"b"', False),  # ... not so written as a range
    (obj({"a": INT}, additionalProperties=STR), '{"a": "x"}', False),  # additional keys exclude listed names
    ({"type": "object", "properties": {"xa": {"type": "integer", "minimum": 5}}, "patternProperties": {"^x.*$": INT},
      "additionalProperties": False}, '{"xa": 1}', True),  # pattern keys do not exclude listed names
    (obj({"a": INT}, additionalProperties=STR, propertyNames={"pattern": "^[a-b]$"}), '{"a": "x"}', True),
    ({"type": "object", "additionalProperties": False, "propertyNames": {"pattern": "^[a-z]$"}}, '{"h": 1}', True),
    ({"type": "object", "properties": {"c": {"type": "null"}}, "patternProperties": {"^.*$": {"type": "null"}},
      "additionalProperties": STR}, '{"k": "x"}', True),  # a key matching a pattern takes the additional schema
]


@pytest.mark.parametrize("schema,text,accepted", XGRAMMAR_FACTS, ids=[str(i) for i in range(len(XGRAMMAR_FACTS))])
def test_xgrammar_behaviour_relied_on(schema, text, accepted):
    assert xgrammar_accepts(schema, text) == accepted


@pytest.mark.parametrize("schema", [
    False, obj({"a": False}), {"enum": []}, {"type": "integer", "minimum": 1.5},
    {"type": "integer", "minimum": -1e30}, {"type": "integer", "minimum": 5, "maximum": 3},
    {"$schema": D4, "type": "number", "minimum": 1, "exclusiveMinimum": True},
    {"type": "array", "items": [INT]}, {"type": "string", "pattern": "^(a)\\1$"},
    {"type": "object", "minProperties": 1}, {"type": "array", "prefixItems": [INT], "maxItems": 0},
])
def test_xgrammar_cannot_compile(schema):
    with pytest.raises(RuntimeError):
        xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)


# The README's examples of keywords no backend enforces (refused unless lenient), and of
# patternProperties, which it once listed among them although one pattern is enforced.
README_REFUSED = [
    ({"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems"),
    ({"type": "number", "multipleOf": 0.01}, "multipleOf"),
    ({"type": "object", "not": {"properties": {"a": INT}}}, "not"),
    ({"type": "object", "patternProperties": {"^x_": INT, "^y_": STR}}, "patternProperties"),
]


@pytest.mark.parametrize(("schema", "keyword"), README_REFUSED, ids=[k for _, k in README_REFUSED])
def test_readme_examples_of_refused_keywords_are_refused(schema, keyword):
    with pytest.raises(GrammarError, match=f"{keyword} at /"):
        prepare_json_schema(schema)
    assert f"{keyword} at /" in prepare_json_schema(schema, lenient=True).dropped


def test_a_single_pattern_property_is_enforced_not_refused():
    prepared = prepare_json_schema({"type": "object", "patternProperties": {"^x_": INT}, "additionalProperties": False})
    assert prepared.dropped == ()
    xgr.Grammar.from_json_schema(prepared.text, any_whitespace=False, strict_mode=True)


TAGGED_A = obj({"kind": {"const": "a"}, "x": INT}, required=["kind"])
TAGGED_B = obj({"kind": {"enum": ["b", "c"]}, "y": STR}, required=["kind", "y"])


@pytest.mark.parametrize("branches,exclusive", [
    ([INT, STR], True),  # different types
    ([{"type": "number"}, STR, {"type": "null"}], True),
    ([TAGGED_A, TAGGED_B], True),  # a required discriminator with disjoint values
    ([TAGGED_A, TAGGED_B, STR], True),
    ([{"enum": [1, "x"]}, {"enum": [2, "y"]}], True),
    ([{"enum": ["x"]}, INT], True),  # an enum's types are its values'
    ([INT, {"type": "number"}], False),  # integers are numbers
    ([{"enum": [1]}, {"enum": [1.0]}], False),  # 1 == 1.0 in JSON Schema
    ([TAGGED_A, obj({"kind": {"enum": ["a", "b"]}}, required=["kind"])], False),  # "a" in both
    ([TAGGED_A, obj({"kind": {"const": "b"}})], False),  # the discriminator is optional in one
    ([TAGGED_A, obj({"kind": STR}, required=["kind"])], False),  # not an enum
    ([{"$ref": "#/$defs/a"}, STR], False),  # not looked through
    ([{}, INT], False),
])
def test_disjoint_oneof_becomes_anyof(branches, exclusive):
    schema = {"oneOf": branches, "$defs": {"a": INT}}
    lowered = json.loads(prepare_json_schema(schema).text)
    assert ("anyOf" in lowered, "oneOf" in lowered) == (exclusive, not exclusive)
    assert len(lowered["anyOf" if exclusive else "oneOf"]) == len(branches)


@pytest.mark.parametrize("as_text", [True, False], ids=["text", "dict"])
def test_schema_over_the_size_limit_is_refused_before_any_work(as_text):
    from arborlm.constrained.json_schema import MAX_SCHEMA_CHARS

    values = [f"v{i:07d}" for i in range(MAX_SCHEMA_CHARS // 10)]  # 11 characters each in JSON
    schema = {"type": "string", "enum": values}
    with pytest.raises(GrammarError) as info:
        prepare_json_schema(json.dumps(schema) if as_text else schema)
    assert info.value.param == "json_schema" and f"the limit is {MAX_SCHEMA_CHARS}" in info.value.message
    small = {"type": "string", "enum": values[:1000]}
    assert json.loads(prepare_json_schema(json.dumps(small) if as_text else small).text)["enum"] == values[:1000]


@pytest.mark.parametrize("schema", [
    {"type": "integer", "maximum": 1e999},
    {"type": "integer", "minimum": -1e999},
    {"type": "integer", "exclusiveMinimum": 1e999},
    {"type": "object", "properties": {"n": {"type": "integer", "maximum": 1e400}}},
])
@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_overflowing_bounds_are_refused_not_crashed(schema, backend):
    """Issue 16: a schema valid under draft 2020-12 never gives a 5xx; a bound that overflows
    an int conversion (found from outside: OverflowError in lowering) is a GrammarError (400)."""
    from arborlm.constrained.grammar_spec import grammar_spec_from_params
    from arborlm.sampling_params import SamplingParams

    try:
        grammar_spec_from_params(SamplingParams(json_schema=schema), backend)
    except GrammarError as e:
        assert e.param == "json_schema"
