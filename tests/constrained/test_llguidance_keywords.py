"""Keywords enforced exactly on the llguidance backend, natively or through `llguidance_rewrite`.

Proof-style, per keyword: on enumerated instances the compiled grammar accepts an
instance's JSON text (as json.dumps writes it) exactly when `jsonschema` says the
instance is valid under the user's schema; and random walks of the grammar that end
validate against it. What stays unenforceable is a 400 naming the keyword unless
lenient."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from arborlm.constrained.base import GrammarError
from arborlm.constrained.grammar_spec import grammar_spec_from_params
from arborlm.constrained.json_schema import LLGUIDANCE_POLICY, prepare_json_schema
from arborlm.constrained.llguidance_backend import LLGuidanceBackend
from arborlm.sampling_params import SamplingParams
from tests.constrained.test_backend_agreement import VOCAB_SIZE, allowed_ids

INT, STR = {"type": "integer"}, {"type": "string"}

# (id, schema, instances): the grammar must accept exactly the valid instances.
EXACT = [
    ("multipleOf integer", {"type": "integer", "multipleOf": 7}, [0, 7, 14, -21, 700, 1, 8, -6, 15]),
    ("multipleOf decimal", {"type": "number", "multipleOf": 0.25}, [0, 0.25, 0.75, -2.75, 3, 0.3, 1.1, -0.2]),
    ("patternProperties", {"type": "object", "properties": {"id": INT}, "patternProperties": {"^x_": STR},
                           "additionalProperties": False},
     [{"id": 1}, {"id": 1, "x_a": "s"}, {"x_b": "t"}, {"id": 1, "x_a": 3}, {"y": "s"}, {"id": "1"}]),
    ("additional excludes declared", {"type": "object", "properties": {"a": INT}, "additionalProperties": STR},
     [{"a": 1}, {"a": 1, "b": "x"}, {"b": "x", "c": "y"}, {"a": "x"}, {"b": 2}]),
    ("propertyNames pattern", {"type": "object", "properties": {"ok": INT, "Bad": INT},
                               "propertyNames": {"pattern": "^[a-z]+$"}},
     [{}, {"ok": 1}, {"ok": 1, "zz": [1]}, {"Bad": 1}, {"A1": 2}, {"ok": 1, "q_": 0}]),
    ("propertyNames enum", {"type": "object", "propertyNames": {"enum": ["a", "b"]},
                            "additionalProperties": INT},
     [{}, {"a": 1}, {"a": 1, "b": 2}, {"c": 1}, {"a": "x"}]),
    ("propertyNames maxLength", {"type": "object", "propertyNames": {"maxLength": 2}},
     [{}, {"ab": 1}, {"abc": 1}, {"a": None, "bb": True}]),
    ("propertyNames false", {"type": "object", "propertyNames": False}, [{}, {"a": 1}]),
    ("minProperties maxProperties", {"type": "object", "additionalProperties": INT,
                                     "minProperties": 1, "maxProperties": 2},
     [{}, {"a": 1}, {"a": 1, "b": 2}, {"a": 1, "b": 2, "c": 3}]),
    ("dependentRequired", {"type": "object", "properties": {"card": STR, "billing": STR, "name": STR},
                           "dependentRequired": {"card": ["billing"]}},
     [{}, {"name": "n"}, {"billing": "b"}, {"card": "c", "billing": "b"}, {"card": "c"}, {"card": "c", "name": "n"}]),
    ("dependencies draft-7", {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                              "properties": {"a": INT, "b": INT}, "dependencies": {"a": ["b"]}},
     [{}, {"b": 1}, {"a": 1, "b": 2}, {"a": 1}]),
    ("dependentSchemas", {"type": "object", "properties": {"kind": STR, "size": INT},
                          "dependentSchemas": {"kind": {"required": ["size"]}}},
     [{}, {"size": 2}, {"kind": "k", "size": 2}, {"kind": "k"}]),
    ("uniqueItems booleans", {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True},
     [[], [True], [False, True], [True, True], [False, False, True]]),
    ("uniqueItems enum", {"type": "array", "items": {"enum": ["r", "g", "b"]}, "uniqueItems": True, "minItems": 1},
     [["r"], ["g", "r"], ["b", "g", "r"], [], ["r", "r"], ["x"], ["r", "g", "b", "r"]]),
    ("uniqueItems false", {"type": "array", "items": INT, "uniqueItems": False}, [[], [1, 1], ["a"]]),
    ("not type", {"not": {"type": ["string", "object"]}}, [1, 2.5, None, True, [1], "s", {}]),
    ("not number", {"not": {"type": "number"}}, [1, 2.5, "s", None]),
    ("not required", {"type": "object", "properties": {"build": STR, "image": STR},
                      "anyOf": [{"required": ["build"], "not": {"required": ["image"]}},
                                {"required": ["image"], "not": {"required": ["build"]}}]},
     [{"build": "b"}, {"image": "i"}, {"build": "b", "image": "i"}, {}]),
    ("not of required names, alone", {"not": {"required": ["a", "b"]}},
     [{}, {"a": 1}, {"b": 1}, {"a": 1, "b": 2}, 3, "s"]),
    ("not empty", {"type": "object", "properties": {"a": INT, "gone": {"not": {}}}},
     [{}, {"a": 1}, {"gone": 1}, {"a": 1, "gone": None}]),
    ("unevaluatedProperties", {"type": "object", "properties": {"a": INT}, "unevaluatedProperties": False},
     [{}, {"a": 1}, {"a": 1, "b": 2}]),
    ("unevaluatedItems", {"type": "array", "prefixItems": [INT], "unevaluatedItems": STR},
     [[], [1], [1, "a", "b"], [1, 2], ["a"]]),
    ("$ref siblings draft-7", {"$schema": "http://json-schema.org/draft-07/schema#",
                               "definitions": {"p": INT}, "type": "object",
                               "properties": {"a": {"$ref": "#/definitions/p", "minimum": 5}}},
     [{"a": 1}, {"a": 9}, {"a": "x"}, {}]),  # draft 7 ignores a $ref's siblings
    ("type implied by refs", {"definitions": {"o": {"type": "object", "properties": {"k": INT}, "required": ["k"],
                                                    "additionalProperties": False}},
                              "anyOf": [{"$ref": "#/definitions/o"}], "type": "object"},
     [{"k": 1}, {}, 3, {"k": "1"}]),
    ("allOf of open objects stays open", {"allOf": [{"properties": {"a": INT}}, {"properties": {"b": INT}}]},
     [{"a": 1, "b": 2}, {"a": 1, "b": 2, "c": 3}, {"a": "x"}, {"b": "y"}]),
    ("$anchor", {"$defs": {"pos": {"$anchor": "positive", "type": "integer", "minimum": 1}},
                 "type": "object", "properties": {"n": {"$ref": "#positive"}}, "required": ["n"]},
     [{"n": 1}, {"n": 40}, {"n": 0}, {"n": "1"}, {}]),
    ("recursive $ref", {"$defs": {"node": {"type": "object", "properties": {
        "v": INT, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"],
        "additionalProperties": False}}, "$ref": "#/$defs/node"},
     [{"v": 1}, {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3, "kids": [{"v": 4, "kids": [{"v": 5}]}]}]}]},
      {"v": 1, "kids": [{"w": 2}]}, {"kids": []}]),
]


@pytest.fixture(scope="module")
def backend(tokenizer, eos) -> LLGuidanceBackend:
    return LLGuidanceBackend(tokenizer, VOCAB_SIZE, [eos])


def accepts(backend, tokenizer, eos, grammar, text: str) -> bool:
    matcher = grammar.new_matcher()
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and \
        matcher.accept_token(eos)


def random_walks(grammar, tokenizer, eos, count: int, seed: int, max_steps: int = 200) -> list[str]:
    """Texts of ``count`` random walks of ``grammar`` that ended (EOS taken with p=0.5 once allowed)."""
    import numpy as np

    from arborlm.constrained.base import allocate_vocab_mask

    rng, texts = random.Random(seed), []
    for _ in range(count):
        matcher, tokens, mask = grammar.new_matcher(), [], allocate_vocab_mask(1, VOCAB_SIZE)
        for _ in range(max_steps):
            matcher.fill_vocab_mask(mask, 0)
            allowed = np.flatnonzero(np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little"))
            others = allowed[allowed != eos]
            if eos in allowed and (len(others) == 0 or rng.random() < 0.5):
                assert matcher.accept_token(eos)
                texts.append(tokenizer.decode(tokens))
                break
            token = int(rng.choice(others))
            assert matcher.accept_token(token)
            tokens.append(token)
    return texts


@pytest.mark.parametrize(("schema", "instances"), [c[1:] for c in EXACT], ids=[c[0] for c in EXACT])
def test_the_grammar_accepts_exactly_the_valid_instances(backend, tokenizer, eos, schema, instances):
    spec = grammar_spec_from_params(SamplingParams(json_schema=json.dumps(schema)), "llguidance")
    grammar = backend.compile(spec.key)
    validator = jsonschema.validators.validator_for(schema)(schema)
    verdicts = {json.dumps(i): (accepts(backend, tokenizer, eos, grammar, json.dumps(i)), validator.is_valid(i))
                for i in instances}
    assert {t: v for t, v in verdicts.items() if v[0] != v[1]} == {}
    assert any(valid for _, valid in verdicts.values()) and not all(valid for _, valid in verdicts.values())
    for text in random_walks(grammar, tokenizer, eos, count=4, seed=len(instances)):
        message = spec.validate_output(text)
        assert message is None or "duplicate key" in message, (text, message)


def test_objects_that_leave_additional_properties_out_are_closed_as_on_xgrammar(backend, tokenizer, eos):
    schema = {"type": "object", "properties": {"a": INT, "o": {"type": "object", "properties": {"b": STR}}},
              "required": ["a"]}
    spec = grammar_spec_from_params(SamplingParams(json_schema=json.dumps(schema)), "llguidance")
    grammar = backend.compile(spec.key)
    assert accepts(backend, tokenizer, eos, grammar, '{"a": 1, "o": {"b": "x"}}')
    for text in ('{"a": 1, "z": 2}', '{"a": 1, "o": {"b": "x", "c": 1}}'):  # valid, but not written
        assert spec.validate_output(text) is None and not accepts(backend, tokenizer, eos, grammar, text)
    open_schema = {**schema, "additionalProperties": True}  # said outright: left open
    grammar = backend.compile(grammar_spec_from_params(SamplingParams(json_schema=json.dumps(open_schema)),
                                                       "llguidance").key)
    assert accepts(backend, tokenizer, eos, grammar, '{"a": 1, "z": 2}')


def test_decimal_multiples_are_written_with_the_divisors_fraction_digits(backend, tokenizer, eos):
    # llguidance spells a multiple of 0.25 with two fraction digits: 1.50, never 1.5 (narrower, still sound).
    spec = grammar_spec_from_params(SamplingParams(json_schema=json.dumps({"type": "number", "multipleOf": 0.25})),
                                    "llguidance")
    grammar = backend.compile(spec.key)
    assert accepts(backend, tokenizer, eos, grammar, "1.50") and not accepts(backend, tokenizer, eos, grammar, "1.5")
    assert not accepts(backend, tokenizer, eos, grammar, "1.30")


@pytest.mark.parametrize(("divisor", "multiples", "others"), [
    (0.01, ["71.13", "0.07", "-3.30", "1e-2", "12345678.91"], ["71.131", "0.005"]),
    (0.1, ["0.3", "2.7", "-0.7"], ["0.35"]),
    (0.25, ["1.75", "3"], ["1.3"]),
])
def test_decimal_multiples_validate_exactly(backend, tokenizer, eos, divisor, multiples, others):
    # jsonschema divides floats: 71.13 / 0.01 = 7112.999..., "not a multiple". A random walk on
    # llguidance wrote such an amount, and validation aborted an output the grammar rightly allowed.
    schema = {"type": "object", "properties": {"amount": {"type": "number", "multipleOf": divisor}}}
    spec = grammar_spec_from_params(SamplingParams(json_schema=json.dumps(schema)), "llguidance")
    for number in multiples:
        assert spec.validate_output(f'{{"amount": {number}}}') is None, number
    for number in others:
        assert "not a multiple" in spec.validate_output(f'{{"amount": {number}}}'), number
    grammar = backend.compile(spec.key)
    if divisor == 0.01:
        assert accepts(backend, tokenizer, eos, grammar, '{"amount": 71.13}')


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "array", "items": STR, "uniqueItems": True}, "uniqueItems"),
    ({"if": {"minLength": 3}, "then": {"required": ["b"]}}, "if"),  # no complement of minLength: not rewritten
    ({"type": "array", "contains": {"const": 1}, "minContains": 2}, "contains"),
    ({"not": {"const": [3]}}, "not"),  # of an array: no complement written
    ({"type": "object", "properties": {"a": INT}, "allOf": [{"$ref": "#/$defs/b"}],
      "$defs": {"b": {"properties": {"b": INT}}}, "unevaluatedProperties": False}, "unevaluatedProperties"),
    ({"$dynamicAnchor": "n", "type": "object", "properties": {"c": {"$id": "https://example.com/c",
                                                                     "$dynamicRef": "#n"}}}, "dynamicAnchor"),
])
def test_what_stays_unenforceable_is_refused_by_name_unless_lenient(backend, tokenizer, eos, schema, keyword):
    with pytest.raises(GrammarError, match=keyword):
        grammar_spec_from_params(SamplingParams(json_schema=json.dumps(schema)), "llguidance")
    lenient = grammar_spec_from_params(SamplingParams(json_schema=json.dumps(schema), json_schema_lenient=True),
                                       "llguidance")
    grammar = backend.compile(lenient.key)
    assert allowed_ids(grammar.new_matcher())  # compiles, and the final validation still judges each output


@pytest.mark.parametrize(("schema", "named"), [
    ({"type": "object", "properties": {"n": {"type": "integer", "not": {"minimum": 5}}}}, "not at /properties/n"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems at /"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "object", "properties": {
        "b": {"if": {"minLength": 3}, "then": {"maxLength": 5}}}}}}}, "if at /properties/a/items/properties/b"),
])
def test_a_keyword_llguidance_lacks_is_refused_with_its_path(schema, named):
    with pytest.raises(GrammarError) as info:
        grammar_spec_from_params(SamplingParams(json_schema=json.dumps(schema)), "llguidance")
    assert info.value.param == "json_schema"
    assert f"keywords the grammar cannot enforce: {named}" in info.value.message
    assert "json_schema_lenient" in info.value.message


def test_remote_ref_is_refused_and_nothing_is_fetched():
    schema = {"type": "object", "properties": {"a": {"$ref": "https://example.invalid/schema.json"}}}
    for lenient in (False, True):
        with pytest.raises(GrammarError, match="does not fetch") as info:
            grammar_spec_from_params(SamplingParams(json_schema=json.dumps(schema), json_schema_lenient=lenient),
                                     "llguidance")
        assert info.value.param == "json_schema"


def test_rewrites_leave_the_users_schema_for_validation():
    schema = {"type": "object", "dependentRequired": {"a": ["b"]}, "propertyNames": {"pattern": "^[ab]$"}}
    prepared = prepare_json_schema(schema, policy=LLGUIDANCE_POLICY)
    assert json.loads(prepared.original) == schema
    assert "dependentRequired" not in prepared.text and "propertyNames" not in prepared.text


def test_unique_items_beyond_the_enumeration_bound_stays_refused():
    schema = {"type": "array", "items": {"enum": list(range(8))}, "uniqueItems": True}  # 109601 arrays
    with pytest.raises(GrammarError, match="uniqueItems"):
        grammar_spec_from_params(SamplingParams(json_schema=json.dumps(schema)), "llguidance")
