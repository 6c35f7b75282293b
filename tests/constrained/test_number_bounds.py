"""JSON number literals have as many digits as an int64 or a double needs, no more.

Weak models under greedy decoding wrote ``"population": 11111111...`` until
``max_tokens``. Through the scheduler: test_constraint_semantics.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr
from outlines_core.json_schema import INTEGER, NUMBER, build_regex_from_schema

from arborlm.constrained.base import GrammarKey, allocate_vocab_mask
from arborlm.constrained.grammar_spec import grammar_spec_from_params
from arborlm.constrained.number_bounds import (
    MAX_EXPONENT_DIGITS,
    MAX_FRACTION_DIGITS,
    MAX_INTEGER_DIGITS,
    bound_ebnf_digits,
    bound_regex_digits,
    bounded_number_regex,
)
from arborlm.constrained.outlines_backend import OutlinesBackend
from arborlm.constrained.xgrammar_backend import XGrammarBackend, rewrite_json_grammar
from arborlm.sampling_params import SamplingParams

VOCAB_SIZE = 49152
POPULATION = json.dumps({"type": "object", "properties": {"population": {"type": "integer"}},
                         "required": ["population"]})
RATIO = json.dumps({"type": "object", "properties": {"ratio": {"type": "number"}}, "required": ["ratio"]})

EBNF_REPEATS = [  # (ebnf line, bounded)
    ('basic_integer ::= (("0") | (basic_integer_1 [1-9] [0-9]*))',
     'basic_integer ::= (("0") | (basic_integer_1 [1-9] [0-9]{0, 18}))'),
    ('basic_number_3 ::= ("" | ("." basic_number_digits{1, -1}))\nbasic_number_digits ::= (([0-9]))',
     'basic_number_3 ::= ("" | ("." basic_number_digits{1, 17}))\nbasic_number_digits ::= (([0-9]))'),
    ('e ::= ("" | ([eE] basic_number_4 basic_number_digits{1, -1}))\nbasic_number_digits ::= (([0-9]))',
     'e ::= ("" | ([eE] basic_number_4 basic_number_digits{1, 3}))\nbasic_number_digits ::= (([0-9]))'),
    ("r ::= (([1-9]) | ([1-9] d{1, -1}))\nd ::= (([0-9]))", "r ::= (([1-9]) | ([1-9] d{1, 18}))\nd ::= (([0-9]))"),
    ("r ::= ([1-9] d{25, -1})\nd ::= (([0-9]))", "r ::= ([1-9] d{25, 25})\nd ::= (([0-9]))"),  # a bound that needs more
    ("r ::= ([0-9]+)", "r ::= ([0-9]{1, 18})"),
    ('r ::= ("[0-9]*" [a-z]* x{0, -1})\nx ::= (([0-9a]))', 'r ::= ("[0-9]*" [a-z]* x{0, -1})\nx ::= (([0-9a]))'),
    ('r ::= (Regex("^[1-9] [0-9]*$", json_string=true))', 'r ::= (Regex("^[1-9] [0-9]*$", json_string=true))'),
    (r'r ::= ([^\"\\] "\"" [0-9]*)', r'r ::= ([^\"\\] "\"" [0-9]{0, 18})'),
]


@pytest.mark.parametrize(("ebnf", "expected"), EBNF_REPEATS)
def test_bound_ebnf_digits(ebnf, expected):
    assert bound_ebnf_digits(ebnf) == expected


def test_xgrammar_json_grammar_is_what_the_bound_expects():
    """Pins xgrammar's printed number rules: should they change, the bound would silently stop applying."""
    grammar = xgr.Grammar.from_json_schema(json.dumps({"type": "array", "items": {"type": "number"}}), strict_mode=True)
    bounded = str(rewrite_json_grammar(grammar, bound_digits=True))
    assert "basic_number_digits{1, 17}" in bounded and "basic_number_digits{1, 3}" in bounded
    assert "basic_number_2 ::= ((\"0\") | ([1-9] basic_number_2_1{0, 18}))" in bounded  # parsed back as a rule
    assert "{1, -1}" not in bounded and "[0-9]*" not in bounded
    assert bound_ebnf_digits(bounded) == bounded


def test_outlines_number_regexes_are_what_the_bound_expects():
    assert bounded_number_regex(INTEGER) == "(-)?(0|[1-9][0-9]{0,18})"
    assert bounded_number_regex(NUMBER) == r"((-)?(0|[1-9][0-9]{0,18}))(\.[0-9]{1,17})?([eE][+-][0-9]{1,3})?"
    regex = build_regex_from_schema(json.dumps({"type": "object", "properties": {"a": {"type": "integer"},
                                                                                 "b": {"type": "number"}}}))
    bounded = bound_regex_digits(regex, INTEGER, NUMBER)
    assert "[0-9]*" not in bounded and "[0-9]+" not in bounded and bounded.count("[1-9][0-9]{0,18}") == 3


@pytest.fixture(scope="module")
def backends(tokenizer, eos):
    return {"xgrammar": XGrammarBackend(tokenizer, VOCAB_SIZE, [eos]),
            "outlines": OutlinesBackend(tokenizer, VOCAB_SIZE, [eos])}


def allowed_texts(matcher, tokenizer) -> set[str]:
    mask = allocate_vocab_mask(1, VOCAB_SIZE)
    matcher.fill_vocab_mask(mask, 0)
    bits = (mask[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
    ids = bits.flatten().nonzero().flatten().tolist()
    return {tokenizer.decode([i]) for i in ids}


def drive(matcher, tokenizer, text):
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept_token(token_id), (text, token_id)


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_integer_digits_stop_at_an_int64s(backends, tokenizer, name):
    matcher = backends[name].compile(GrammarKey("json_schema", POPULATION)).new_matcher()
    drive(matcher, tokenizer, '{"population": -' + "1" * (MAX_INTEGER_DIGITS - 1))
    assert "1" in allowed_texts(matcher, tokenizer)
    drive(matcher, tokenizer, "1")
    assert {t.strip() for t in allowed_texts(matcher, tokenizer)} - {""} == {"}"}  # outlines allows a space first


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_number_parts_are_bounded(backends, tokenizer, name):
    matcher = backends[name].compile(GrammarKey("json_schema", RATIO)).new_matcher()
    drive(matcher, tokenizer, '{"ratio": ' + "9" * MAX_INTEGER_DIGITS)
    assert "9" not in allowed_texts(matcher, tokenizer)
    drive(matcher, tokenizer, "." + "5" * MAX_FRACTION_DIGITS)
    assert "5" not in allowed_texts(matcher, tokenizer)
    drive(matcher, tokenizer, "e+" + "3" * MAX_EXPONENT_DIGITS)
    assert {t.strip() for t in allowed_texts(matcher, tokenizer)} - {""} == {"}"}


def test_any_json_numbers_are_bounded_too(backends, tokenizer):
    matcher = backends["xgrammar"].compile(GrammarKey("json_object", "")).new_matcher()
    drive(matcher, tokenizer, "[" + "7" * MAX_INTEGER_DIGITS)
    assert "7" not in allowed_texts(matcher, tokenizer)


@pytest.mark.parametrize("schema", [{"type": "integer", "minimum": 0}, {"type": "number", "minimum": 0}])
def test_one_sided_ranges_are_bounded(backends, tokenizer, schema):
    """xgrammar writes a range of its own; its open side gets the same bound."""
    matcher = backends["xgrammar"].compile(GrammarKey("json_schema", json.dumps(schema))).new_matcher()
    drive(matcher, tokenizer, str(2**63 - 1))
    assert not {t for t in allowed_texts(matcher, tokenizer) if t[:1].isdigit()}


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_lenient_mode_lifts_the_digit_bound(backends, tokenizer, name):
    """`json_schema_lenient` lifts the default digit bound (issue 16: "the lenient mode lifts it")."""
    key = grammar_spec_from_params(SamplingParams(json_schema=POPULATION, json_schema_lenient=True), name).key
    assert key.lenient
    matcher = backends[name].compile(key).new_matcher()
    drive(matcher, tokenizer, '{"population": ' + "1" * (3 * MAX_INTEGER_DIGITS))
    assert "1" in allowed_texts(matcher, tokenizer)
    strict = grammar_spec_from_params(SamplingParams(json_schema=POPULATION), name).key
    assert not strict.lenient and strict != key  # compiled and cached apart
