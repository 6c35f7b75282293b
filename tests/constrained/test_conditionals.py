"""``if``/``then``/``else``, bounded ``contains``, ``not`` of ``const``/``enum`` and ``$dynamicRef``, rewritten (`conditionals`,
`complement`) and enforced on xgrammar and llguidance.

Proof-style: `complement` is checked against ``jsonschema`` on a pool of values (the
complement accepts exactly what the schema rejects); on each backend the compiled grammar
accepts an enumerated instance's JSON text exactly when ``jsonschema`` says it is valid
under the ORIGINAL schema (for the enumerable ones every instance of the language's
shape is listed), and random walks of the grammar validate against it. What has no
equivalent rewrite stays a 400 naming the keyword.
"""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest

from arborlm.constrained.base import GrammarError
from arborlm.constrained.grammar_spec import grammar_spec_from_params
from arborlm.constrained.json_schema.complement import complement, not_strings_pattern
from arborlm.constrained.llguidance_backend import LLGuidanceBackend
from arborlm.constrained.xgrammar_backend import XGrammarBackend
from arborlm.sampling_params import SamplingParams
from tests.constrained.test_backend_agreement import VOCAB_SIZE
from tests.constrained.test_llguidance_keywords import accepts, random_walks

INT, STR = {"type": "integer"}, {"type": "string"}
BACKENDS = ("xgrammar", "llguidance")

POOL = [None, True, False, 0, 1, -1, 2, 2.5, 1.0, 7, "", "a", "US", "USA", "U", "us", "a\nb", [], [1], {},
        {"a": 1}, {"a": "x"}, {"b": 1}, {"a": 1, "b": 2}, {"country": "US"}, {"country": "FR"}]


@pytest.mark.parametrize("schema", [
    {"type": "string"}, {"type": ["integer", "number"]}, {"type": ["null", "object"]}, {"const": "US"},
    {"enum": ["US", "USA", 1, 2.5, None, True]}, {"required": ["a", "b"]},
    {"properties": {"a": {"const": 1}}, "required": ["a"]},
    {"type": "object", "properties": {"country": {"enum": ["US", "CA"]}}},
    True, False, {},
], ids=lambda s: json.dumps(s)[:40])
def test_complement_accepts_exactly_what_the_schema_rejects(schema):
    negated = complement(schema, 2020)
    assert negated is not None
    for value in POOL:
        assert jsonschema.Draft202012Validator(negated).is_valid(value) != \
            jsonschema.Draft202012Validator(schema).is_valid(value), (value, negated)


@pytest.mark.parametrize("schema", [
    {"minLength": 3}, {"type": "integer"}, {"enum": [[1]]}, {"properties": {"a": {"pattern": "x"}}},
    {"anyOf": [INT]},
])
def test_complement_of_what_it_cannot_write_is_none(schema):
    assert complement(schema, 2020) is None


def test_not_strings_pattern_excludes_exactly_the_strings():
    import re

    excluded = ["US", "USA", "a.b", "[x]", "é"]
    pattern = not_strings_pattern(excluded)
    for s in ["", "U", "USB", "USAX", "a.bc", "axb", "[x", "e", "\n", *excluded]:
        assert (re.search(pattern, s) is None) == (s in excluded), s


IF_ENUM = {"type": "object", "properties": {"kind": {"enum": ["card", "cash"]}, "fee": {"enum": [0, 1, 2]}},
           "required": ["kind", "fee"], "additionalProperties": False,
           "if": {"properties": {"kind": {"const": "card"}}}, "then": {"properties": {"fee": {"const": 0}}},
           "else": {"properties": {"fee": {"minimum": 1}}}}
IF_STRINGS = {"type": "object", "properties": {"country": STR, "zip": STR}, "required": ["country", "zip"],
              "additionalProperties": False,
              "if": {"properties": {"country": {"const": "US"}}},
              "then": {"properties": {"zip": {"pattern": "^[0-9]{2}$"}}},
              "else": {"properties": {"zip": {"maxLength": 1}}}}
IF_TYPE = {"if": {"type": "string"}, "then": {"maxLength": 2}, "else": {"type": "integer", "maximum": 3}}
CONTAINS_MAX = {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 3, "contains": {"const": 1},
                "minContains": 1, "maxContains": 2}
CONTAINS_TUPLE = {"type": "array", "prefixItems": [INT, STR, INT], "items": False, "contains": {"type": "string"}}
DYNAMIC = {"$dynamicAnchor": "node", "type": "object",
           "properties": {"v": INT, "kids": {"type": "array", "items": {"$dynamicRef": "#node"}, "maxItems": 2}},
           "required": ["v"], "additionalProperties": False}

# (id, schema, instances): the grammar must accept exactly the valid ones.
EXACT = [
    ("if enum, enumerated", IF_ENUM,
     [{"kind": k, "fee": f} for k, f in itertools.product(["card", "cash", "coin"], [0, 1, 2, 3])] + [{"kind": "card"}]),
    ("if const string", IF_STRINGS,
     [{"country": c, "zip": z} for c, z in itertools.product(["US", "USA", "U", "FR"], ["12", "1", "123", ""])]),
    ("if type", IF_TYPE, ["", "ab", "abc", 1, 3, 4, -2, 2.5, None]),
    ("contains maxContains, enumerated", CONTAINS_MAX,
     [list(t) for n in range(5) for t in itertools.product([1, 2], repeat=n)]),
    ("contains in a tuple", CONTAINS_TUPLE, [[1, "a", 2], [1, "a"], [1], [], [1, 2, 3]]),
    ("not const", {"not": {"const": 3}}, [3, 3.0, 2, 4, 2.5, -3, "3", None, True, [3], {}]),
    ("not enum of strings", {"type": "object", "properties": {"s": {"type": "string", "not": {"enum": ["a", "ab"]}}},
                             "required": ["s"], "additionalProperties": False},
     [{"s": v} for v in ["a", "ab", "", "b", "abc", "aa", "ba"]] + [{"s": 1}]),
    ("$dynamicRef at the root", DYNAMIC,
     [{"v": 1}, {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}, {"v": 1, "kids": [{"w": 2}]}, {"kids": []},
      {"v": 1, "kids": [{"v": 2}, {"v": 3}, {"v": 4}]}]),
]


@pytest.fixture(scope="module")
def backends(tokenizer, eos) -> dict:
    return {"xgrammar": XGrammarBackend(tokenizer, VOCAB_SIZE, [eos], max_threads=2),
            "llguidance": LLGuidanceBackend(tokenizer, VOCAB_SIZE, [eos])}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("schema", "instances"), [c[1:] for c in EXACT], ids=[c[0] for c in EXACT])
def test_the_grammar_accepts_exactly_the_valid_instances(backends, tokenizer, eos, backend, schema, instances):
    spec = grammar_spec_from_params(SamplingParams(json_schema=json.dumps(schema)), backend)
    grammar = backends[backend].compile(spec.key)
    validator = jsonschema.validators.validator_for(schema)(schema)  # the ORIGINAL schema
    verdicts = {json.dumps(i): (accepts(None, tokenizer, eos, grammar, json.dumps(i)), validator.is_valid(i))
                for i in instances}
    assert {t: v for t, v in verdicts.items() if v[0] != v[1]} == {}
    assert any(valid for _, valid in verdicts.values()) and not all(valid for _, valid in verdicts.values())
    for text in random_walks(grammar, tokenizer, eos, count=4, seed=len(instances)):
        assert validator.is_valid(json.loads(text)), text


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("schema", "keyword"), [
    ({"if": {"minLength": 3}, "then": {"maxLength": 5}}, "if"),  # no complement of minLength here
    ({"type": "array", "items": INT, "contains": {"const": 1}}, "contains"),  # unbounded length
    ({"type": "array", "maxItems": 3, "contains": {"minLength": 2}, "maxContains": 1}, "contains"),
    ({"$dynamicAnchor": "n", "type": "object", "properties": {"c": {"$id": "inner", "$dynamicAnchor": "n",
                                                                     "items": {"$dynamicRef": "#n"}}}}, "ynamic"),
])
def test_what_has_no_equivalent_stays_refused_by_name(backend, schema, keyword):
    with pytest.raises(GrammarError, match=keyword) as info:
        grammar_spec_from_params(SamplingParams(json_schema=json.dumps(schema)), backend)
    assert info.value.param == "json_schema"


def test_too_many_contains_branches_stay_refused():
    schema = {"type": "array", "maxItems": 6, "contains": {"const": 1}, "minContains": 2, "maxContains": 4}
    with pytest.raises(GrammarError, match="contains"):  # C(6,2) + C(6,3) + C(6,4) + ... > 64 branches
        grammar_spec_from_params(SamplingParams(json_schema=json.dumps(schema)), "xgrammar")
