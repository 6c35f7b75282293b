"""A `propertyNames` that lists its names is written as declared properties, so no name repeats.

An open object's grammar cannot remember which names it wrote: with the names allowed
through `patternProperties` a model wrote `{"r": 9, "r": 1}` (found by a user trial at
temperature 1: 5 of 16 outputs aborted by validation as duplicate keys). Declared
properties are written in order, each at most once.
"""

from __future__ import annotations

import json

import pytest

from arborlm.constrained.base import GrammarError
from arborlm.constrained.grammar_manager import create_grammar_backend
from arborlm.constrained.grammar_spec import grammar_spec_from_params
from arborlm.constrained.json_schema.property_names import (
    MAX_NAMES_AS_PROPERTIES,
    names_as_properties,
)
from arborlm.sampling_params import SamplingParams

VOCAB_SIZE = 49152
PQR = {"type": "object", "propertyNames": {"enum": ["p", "q", "r"]}, "additionalProperties": {"type": "integer"}}
TWO_OF_PQR = {"type": "object", "propertyNames": {"enum": ["p", "q", "r"]}, "minProperties": 2, "maxProperties": 2}
# (schema, outputs it allows, outputs it does not), per backend that takes it
CASES = {
    "xgrammar": [
        (PQR, ['{"p": 1, "r": 2}', '{}', '{"q": 3}'], ['{"r": 1, "r": 2}', '{"p": "x"}', '{"s": 1}']),
        (TWO_OF_PQR, ['{"p": 1, "q": 2}', '{"q": [], "r": null}'],
         ['{"p": 1, "p": 2}', '{"p": 1}', '{"p": 1, "q": 2, "r": 3}']),
    ],
    "llguidance": [
        (PQR, ['{"p": 1, "r": 2}', '{}', '{"q": 3}'], ['{"r": 1, "r": 2}', '{"p": "x"}', '{"s": 1}']),
    ],
}


@pytest.fixture(scope="module")
def backends(tokenizer, eos):
    return {name: create_grammar_backend(name, tokenizer, VOCAB_SIZE, [eos]) for name in CASES}


def accepts(backend, tokenizer, eos, grammar, text: str) -> bool:
    matcher = grammar.new_matcher()
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
        and matcher.accept_token(eos)


@pytest.mark.parametrize("name", sorted(CASES))
def test_listed_names_are_written_at_most_once(backends, tokenizer, eos, name):
    for schema, allowed, refused in CASES[name]:
        spec = grammar_spec_from_params(SamplingParams(json_schema=json.dumps(schema)), name)
        grammar = backends[name].compile(spec.key)
        for text in allowed:
            assert spec.validate_output(text) is None and accepts(backends[name], tokenizer, eos, grammar, text), text
        for text in refused:
            assert not accepts(backends[name], tokenizer, eos, grammar, text), text


def test_min_max_properties_over_listed_names_are_refused_on_llguidance_not_left_to_validation():
    with pytest.raises(GrammarError, match="min/maxProperties"):
        grammar_spec_from_params(SamplingParams(json_schema=json.dumps(TWO_OF_PQR)), "llguidance")
    spec = grammar_spec_from_params(SamplingParams(json_schema=json.dumps(TWO_OF_PQR)), "auto")
    assert spec.key.backend == "xgrammar"


def test_the_rewrite():
    schema = {"type": "object", "properties": {"p": {"type": "string"}, "z": {}}, "required": ["p"],
              "propertyNames": {"type": "string", "enum": ["p", "q"]}, "additionalProperties": {"type": "integer"}}
    assert names_as_properties(schema) == {
        "type": "object", "properties": {"p": {"type": "string"}, "z": False, "q": {"type": "integer"}},
        "required": ["p"], "additionalProperties": False}
    assert names_as_properties({"propertyNames": {"const": "a"}}) == {"properties": {"a": {}},
                                                                      "additionalProperties": False}
    # Left alone: beside patternProperties, names that are not all strings, too many names, other conditions.
    for names in ({"enum": ["a", 1]}, {"enum": [f"n{i}" for i in range(MAX_NAMES_AS_PROPERTIES + 1)]},
                  {"enum": ["a"], "maxLength": 3}, {"pattern": "^a$"}, {"enum": ["a"], "const": "a"}, {"enum": ["a"], "type": "integer"}):
        schema = {"type": "object", "propertyNames": names}
        assert names_as_properties(json.loads(json.dumps(schema))) == schema
    schema = {"type": "object", "propertyNames": {"enum": ["a"]}, "patternProperties": {"^b$": {}}}
    assert names_as_properties(json.loads(json.dumps(schema))) == schema
