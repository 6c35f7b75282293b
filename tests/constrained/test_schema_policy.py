"""SchemaPolicy: each grammar backend names how it takes a JSON schema, and `prepare_json_schema`
runs only what the policy asks for (the as-written form a backend that enforces JSON Schema
itself would take; relax only in lenient mode). The backend names are one list."""

from __future__ import annotations

import json

import pytest

from arborlm.constrained.base import GrammarError
from arborlm.constrained.json_schema import (
    LENIENT_MARK,
    LLGUIDANCE_POLICY,
    OUTLINES_POLICY,
    XGRAMMAR_POLICY,
    Relaxed,
    SchemaForm,
    SchemaPolicy,
    prepare_json_schema,
)
from arborlm.constrained.registry import GRAMMAR_BACKEND_NAMES, backend_class
from arborlm.runtime.config import GRAMMAR_BACKENDS

D4 = "http://json-schema.org/draft-04/schema#"
# Kept as written: a draft-4 tuple, an annotation, a keyword xgrammar's form refuses, user order.
AS_WRITTEN_CASES = [
    {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}, "required": ["z"]},
    {"$schema": D4, "type": "array", "items": [{"type": "integer"}], "additionalItems": False},
    {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "description": "tags"},
    {"not": {"enum": [[1], [2]]}},
]


def as_written(relax=None) -> SchemaPolicy:
    return SchemaPolicy("test", SchemaForm.AS_WRITTEN, relax=relax)


@pytest.mark.parametrize("name", GRAMMAR_BACKEND_NAMES)
def test_each_backend_names_its_policy(name):
    cls = backend_class(name)
    assert cls.name == name
    # "auto" prepares a key that names no backend (a tool call's schema) as its first choice, xgrammar.
    assert cls.schema_policy.backend == (name if name != "auto" else "xgrammar")
    assert cls.schema_policy is {"xgrammar": XGRAMMAR_POLICY, "outlines": OUTLINES_POLICY,
                                 "llguidance": LLGUIDANCE_POLICY, "auto": XGRAMMAR_POLICY}[name]


def test_the_config_checks_backend_names_against_the_one_list():
    assert GRAMMAR_BACKENDS is GRAMMAR_BACKEND_NAMES


@pytest.mark.parametrize("schema", AS_WRITTEN_CASES, ids=range(len(AS_WRITTEN_CASES)))
def test_as_written_form_compiles_the_users_schema(schema):
    prepared = prepare_json_schema(schema, policy=as_written())
    assert prepared.text == json.dumps(schema)  # property order kept, nothing rewritten or refused
    assert prepared.dropped == ()
    reference = prepare_json_schema({"type": "integer"})
    assert prepared.dialect == (D4 if "$schema" in schema else reference.dialect)


def test_as_written_form_still_parses_and_checks_the_dialect():
    with pytest.raises(GrammarError, match="not valid JSON"):
        prepare_json_schema('{"type": ', policy=as_written())
    with pytest.raises(GrammarError, match="not a valid JSON Schema"):
        prepare_json_schema({"type": "foo"}, policy=as_written())
    with pytest.raises(GrammarError, match="accepts no value"):
        prepare_json_schema(False, policy=as_written())
    assert prepare_json_schema(True, policy=as_written()).text == "{}"


def test_xgrammar_form_refuses_what_as_written_passes():
    with pytest.raises(GrammarError, match="uniqueItems"):
        prepare_json_schema(AS_WRITTEN_CASES[2], policy=XGRAMMAR_POLICY)


def test_relax_runs_only_when_lenient_on_a_fresh_value():
    seen = []

    def relax(schema: dict) -> Relaxed:
        seen.append(schema)
        schema.pop("maxItems", None)  # it may change the value it is given
        return Relaxed({**schema, "x-lenient": True}, ("maxItems at /",))

    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
    strict = prepare_json_schema(schema, policy=as_written(relax))
    assert seen == [] and strict.text == json.dumps(schema)
    lenient = prepare_json_schema(schema, lenient=True, policy=as_written(relax))
    assert json.loads(lenient.text) == {"type": "array", "items": {"type": "integer"}, "x-lenient": True}
    assert lenient.dropped == ("maxItems at /",)
    assert schema["maxItems"] == 3  # the caller's schema is untouched


def test_a_relax_that_drops_nothing_leaves_the_text_alone():
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "null"}}}
    prepared = prepare_json_schema(schema, lenient=True, policy=as_written(lambda s: Relaxed({"changed": True})))
    assert prepared.text == json.dumps(schema)


def test_outlines_policy_lowers_like_xgrammar_then_relaxes():
    schema = {"type": "integer", "minimum": 1.5, "maximum": 9}
    on_xgrammar = prepare_json_schema(schema, lenient=True)
    on_outlines = prepare_json_schema(schema, lenient=True, policy=OUTLINES_POLICY)
    assert json.loads(on_xgrammar.text) == {"type": "integer", "minimum": 2, "maximum": 9}
    assert json.loads(on_outlines.text) == {"type": "integer", LENIENT_MARK: True}
    assert on_outlines.dropped == ("maximum at /", "minimum at /")  # outlines drops in sorted order
    assert prepare_json_schema(schema, policy=OUTLINES_POLICY).text == on_xgrammar.text  # strict: no relax


def test_llguidance_policy_keeps_the_schema_but_formats_it_does_not_know_and_closes_objects():
    schema = {"type": "object", "properties": {
        "format": {"type": "string", "format": "uri-reference"},  # a property called "format" stays
        "when": {"type": "string", "format": "date"},
        "tags": {"type": "array", "items": {"type": "string", "format": "iri"}, "uniqueItems": True}},
        "enum": [{"format": "x"}]}  # values are not schemas
    prepared = prepare_json_schema(schema, policy=LLGUIDANCE_POLICY)
    expected = json.loads(json.dumps(schema))
    del expected["properties"]["format"]["format"], expected["properties"]["tags"]["items"]["format"]
    expected["additionalProperties"] = False  # closed, as xgrammar's strict mode does
    assert json.loads(prepared.text) == expected and list(json.loads(prepared.text)["properties"]) == [
        "format", "when", "tags"]
    assert prepared.dropped == () and json.loads(prepared.original) == schema  # outputs judged by the user's
    assert schema["properties"]["format"]["format"] == "uri-reference"  # the caller's schema is untouched
