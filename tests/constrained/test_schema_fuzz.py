"""Any valid draft 2020-12 schema is prepared or refused with a `GrammarError`, never another
exception (issue 16, item 3): a 5xx is never the answer to a valid schema.

Hypothesis builds nested schemas from the 2020-12 keywords (applicators, ``$ref`` into a
fixed ``$defs``, ``patternProperties``, conditionals, dependencies, ``contains``,
``unevaluated*``, ...), keeps those the metaschema accepts, and runs each through
`prepare_json_schema` for every backend's policy, strict and lenient, then through
`validate_json_output`. (Not through the backends' own checks: outlines-core builds its
index there, which for some lenient schemas takes minutes.) Also the crashes it found,
as fixed cases.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from jsonschema import exceptions as js_exceptions
from jsonschema import validators as js_validators

from arborlm.constrained.json_schema import (
    OUTLINES_POLICY,
    XGRAMMAR_POLICY,
    PreparedSchema,
    prepare_json_schema,
    validate_json_output,
)
from arborlm.constrained.json_schema.parse import MAX_SCHEMA_DEPTH
from arborlm.constrained.keys import GrammarError

DIALECT = "https://json-schema.org/draft/2020-12/schema"
POLICIES = [XGRAMMAR_POLICY, OUTLINES_POLICY]
DEF_NAMES = ["d0", "d1"]
NAMES = st.sampled_from(["a", "b", "ab", "x_1", ""])
PATTERNS = st.sampled_from(["^a$", "^a", "a", "^x_", ".*", "^[a-z]+$", "^(a|b)$", "b$", "^$"])
TYPES = st.sampled_from(["null", "boolean", "object", "array", "number", "integer", "string"])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.sampled_from([0.5, -1.5]) | st.sampled_from(["a", "ab", ""]),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(NAMES, inner, max_size=2),
    max_leaves=4,
)
SMALL = st.integers(0, 3)


def _keyword_table(child: st.SearchStrategy) -> dict[str, st.SearchStrategy]:
    """Each 2020-12 keyword drawn, and the strategy of its value (subschemas from ``child``)."""
    return {
        "type": TYPES | st.lists(TYPES, min_size=1, max_size=3, unique=True),
        "enum": st.lists(JSON_VALUES, min_size=1, max_size=3),
        "const": JSON_VALUES,
        "minimum": st.integers(-3, 3), "exclusiveMaximum": st.integers(-3, 3),
        "multipleOf": st.sampled_from([1, 2, 0.5]),
        "minLength": SMALL, "maxLength": SMALL, "pattern": PATTERNS, "format": st.sampled_from(["date", "email"]),
        "items": child, "prefixItems": st.lists(child, min_size=1, max_size=2),
        "contains": child, "minContains": SMALL, "maxContains": SMALL,
        "minItems": SMALL, "maxItems": SMALL, "uniqueItems": st.booleans(), "unevaluatedItems": child,
        "properties": st.dictionaries(NAMES, child, max_size=3),
        "patternProperties": st.dictionaries(PATTERNS, child, max_size=2),
        "additionalProperties": child, "propertyNames": child, "unevaluatedProperties": child,
        "required": st.lists(NAMES, max_size=3, unique=True),
        "minProperties": SMALL, "maxProperties": SMALL,
        "dependentRequired": st.dictionaries(NAMES, st.lists(NAMES, max_size=2, unique=True), max_size=2),
        "dependentSchemas": st.dictionaries(NAMES, child, max_size=2),
        "allOf": st.lists(child, min_size=1, max_size=3), "anyOf": st.lists(child, min_size=1, max_size=3),
        "oneOf": st.lists(child, min_size=1, max_size=3), "not": child,
        "if": child, "then": child, "else": child,
        "$ref": st.sampled_from(["#", "#a", "#/properties/a", "#/$defs/d0/properties/a",
                                 *(f"#/$defs/{n}" for n in DEF_NAMES)]),
        "$anchor": st.just("a"), "$dynamicRef": st.just("#"),
        "title": st.just("t"), "$comment": st.just("c"),
    }


def _draw_few(child: st.SearchStrategy) -> st.SearchStrategy:
    """A schema object of up to four keywords (chosen first, so that only their values are drawn)."""
    table = _keyword_table(child)
    return st.lists(st.sampled_from(sorted(table)), max_size=4, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: table[k] for k in keys}))


SUBSCHEMAS = st.recursive(st.booleans() | _draw_few(st.booleans()), _draw_few, max_leaves=25)
DOCUMENTS = st.fixed_dictionaries({
    "$defs": st.fixed_dictionaries({name: SUBSCHEMAS for name in DEF_NAMES}),
}).flatmap(lambda head: _draw_few(SUBSCHEMAS).map(lambda body: {"$schema": DIALECT, **head, **body}))


def _prepare_as_a_request_would(schema: dict, policy, lenient: bool) -> None:
    """Prepare and validate a few outputs; only `GrammarError` may escape."""
    try:
        prepared = prepare_json_schema(schema, lenient=lenient, policy=policy)
    except GrammarError:
        return
    for output in ("{}", "[]", '"a"', "1", '{"a": {"a": []}}'):
        validate_json_output(prepared, output)  # a message or None, never an exception


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(schema=DOCUMENTS)
def test_a_valid_2020_12_schema_is_prepared_or_refused(schema):
    try:
        js_validators.Draft202012Validator.check_schema(schema)
    except js_exceptions.SchemaError:
        assume(False)
    for policy in POLICIES:
        for lenient in (False, True):
            _prepare_as_a_request_would(schema, policy, lenient)


# Found by the property above or named in issue 16; each raised something else than GrammarError.
CRASHES = {
    # a listed property that also matches a patternProperties entry, both recursive $refs: RecursionError
    "recursive property under a recursive pattern": {
        "$defs": {"n": {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}},
                        "patternProperties": {"^a$": {"$ref": "#/$defs/m"}}},
                  "m": {"type": "object", "properties": {"a": {"$ref": "#/$defs/m"}}}},
        "$ref": "#/$defs/n"},
    "required name under two recursive patterns": {
        "$defs": {"n": {"type": "object", "required": ["ab"],
                        "patternProperties": {"^a": {"$ref": "#/$defs/n"}, "b$": {"$ref": "#/$defs/m"}}},
                  "m": {"type": "object", "patternProperties": {"^a": {"$ref": "#/$defs/m"}}}},
        "$ref": "#/$defs/n"},
    # a JSON pointer through a boolean schema, or with a word as an array index: TypeError, ValueError
    "$ref through a boolean": {"$defs": {"d0": True}, "$ref": "#/$defs/d0/properties/a"},
    "$ref with a word as an index": {"$defs": {"d0": {"anyOf": [{}]}}, "$ref": "#/$defs/d0/anyOf/x"},
    # a $ref that phase A does not follow (an `if` without `then`), but the output validation does:
    # jsonschema's Unresolvable escaped validate_json_output
    "unresolvable $ref under a lone if": {"if": {"const": None, "$ref": "#a"}},
    "unresolvable $ref under contains with minContains 0": {"contains": {"$ref": "#/nope"}, "minContains": 0},
    # nested deeper than Python's stack allows the phases: RecursionError
    "nested 300 arrays deep": json.loads('{"type":"array","items":' * 300 + "{}" + "}" * 300),
    "nested 100 objects deep": json.loads('{"type":"object","properties":{"a":' * 100 + "{}" + "}}" * 100),
    # a chain of 400 definitions, each merged with its sibling keywords, unfolded one inside the other
    "a long chain of merged references": {
        "$defs": {f"d{i}": {"type": "object", "minProperties": 1, "allOf": [{"$ref": f"#/$defs/d{i + 1}"}]}
                  for i in range(400)} | {"d400": {"type": "object"}},
        "$ref": "#/$defs/d0"},
}


def test_an_output_whose_validation_never_ends_is_reported():
    """Found by the property: ``if`` applies the root to the same value again; jsonschema recursed
    until ``referencing``'s Rust maps panicked (a PanicException, not a RecursionError)."""
    schema = {"$schema": DIALECT, "minimum": 0, "additionalProperties": {"$dynamicRef": "#", "maxItems": 1},
              "if": {"$dynamicRef": "#", "maxItems": 1}}
    prepared = prepare_json_schema(schema, lenient=True)
    assert "recurses without end" in validate_json_output(prepared, '{"a": []}')


def test_output_validation_reports_what_the_validator_raises():
    """It runs on the front's event loop: a schema jsonschema cannot follow is a message, not a raise."""
    prepared = PreparedSchema("{}", json.dumps({"if": {"$ref": "#a"}}, sort_keys=True))
    assert "could not be validated" in validate_json_output(prepared, "1")


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.backend)
@pytest.mark.parametrize("lenient", [False, True])
@pytest.mark.parametrize("name", sorted(CRASHES))
def test_found_crashes_are_prepared_or_refused(name, lenient, policy):
    _prepare_as_a_request_would(CRASHES[name], policy, lenient)


def test_the_recursive_pattern_schema_compiles_when_lenient():
    prepared = prepare_json_schema(CRASHES["recursive property under a recursive pattern"], lenient=True)
    assert validate_json_output(prepared, '{"a": {"a": {}}}') is None
    assert validate_json_output(prepared, '{"a": {"a": 1}}') is not None


def test_too_deep_a_schema_is_refused_naming_where():
    with pytest.raises(GrammarError, match=f"limit of {MAX_SCHEMA_DEPTH} levels, at /items/items"):
        prepare_json_schema(CRASHES["nested 300 arrays deep"])
