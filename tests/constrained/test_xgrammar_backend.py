"""XGrammarBackend on SmolLM2's tokenizer: matchers driven by hand token by token."""

from __future__ import annotations

import json

import pytest
import torch

from arborlm.constrained.base import GrammarError, GrammarKey, allocate_vocab_mask, apply_vocab_mask
from arborlm.constrained.grammar_manager import create_grammar_backend
from arborlm.constrained.registry import backend_class
from arborlm.constrained.xgrammar_backend import (
    TAG_MAX_WHITESPACE,
    XGrammarBackend,
    structural_tag_json,
)

VOCAB_SIZE = 49152
NAME_SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
TAG = {
    "type": "structural_tag",
    "format": {"type": "tag", "begin": "<call>", "content": {"type": "json_schema", "json_schema": json.loads(NAME_SCHEMA)},
               "end": "</call>"},
}
LEGACY_TAG = {"structures": [{"begin": "<f=get>", "schema": json.loads(NAME_SCHEMA), "end": "</f>"}], "triggers": ["<f="]}

# (key, a complete output valid under it)
VALID = [
    (GrammarKey("json_schema", NAME_SCHEMA), '{"name": "Bob"}'),
    (GrammarKey("json_schema", "$$ANY$$"), '{"a": [1, 2.5, null]}'),
    (GrammarKey("json_object", ""), '{"a": [1, {"b": true}], "c": "x"}'),
    (GrammarKey("json_object", ""), "[1, 2]"),
    (GrammarKey("json_object", ""), "42"),
    (GrammarKey("json_object", ""), '"just a string"'),
    (GrammarKey("json_object", ""), "null"),
    (GrammarKey("regex", r"\d{3}-[a-z]+"), "123-abc"),
    (GrammarKey("ebnf", 'root ::= "yes" | "no" | "maybe " num\nnum ::= [0-9]+'), "maybe 42"),
    (GrammarKey("structural_tag", json.dumps(TAG)), '<call>{"name": "x"}</call>'),
    (GrammarKey("structural_tag", json.dumps(LEGACY_TAG)), 'Sure. <f=get>{"name": "a"}</f> done'),
]

# (key, the param the error must name)
INVALID = [
    (GrammarKey("regex", "a(b"), "regex"),
    (GrammarKey("regex", "[z-a]"), "regex"),
    (GrammarKey("ebnf", 'root ::= "a" |'), "ebnf"),
    (GrammarKey("ebnf", 'start ::= "a"'), "ebnf"),  # no root rule
    (GrammarKey("ebnf", "root ::= missing"), "ebnf"),
    (GrammarKey("json_schema", '{"type": '), "json_schema"),
    (GrammarKey("json_schema", '{"type": "foo"}'), "json_schema"),
    (GrammarKey("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'), "json_schema"),
    (GrammarKey("structural_tag", "not json"), "structural_tag"),
    (GrammarKey("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}'), "structural_tag"),
    (GrammarKey("structural_tag", '{"structures": [{"begin": "<a>"}], "triggers": ["<a"]}'), "structural_tag"),
    (GrammarKey("xml", "<a/>"), "xml"),
]


@pytest.fixture(scope="module")
def backend(tokenizer, eos):
    return XGrammarBackend(tokenizer, VOCAB_SIZE, [eos], max_threads=2)


def allowed_ids(vocab_mask: torch.Tensor, row: int = 0) -> set[int]:
    bits = (vocab_mask[row].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1  # (V/32, 32)
    return set(bits.flatten().nonzero().flatten().tolist())


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(("key", "text"), VALID, ids=[f"{k.kind}-{t[:12]}" for k, t in VALID])
def test_matcher_accepts_valid_output_token_by_token(backend, tokenizer, eos, key, text):
    XGrammarBackend.check(key)
    matcher = backend.compile(key).new_matcher()
    vocab_mask = allocate_vocab_mask(1, VOCAB_SIZE)
    for token_id in encode(tokenizer, text):
        matcher.fill_vocab_mask(vocab_mask, 0)
        assert token_id in allowed_ids(vocab_mask), tokenizer.decode([token_id])
        assert matcher.accept_token(token_id)
        assert not matcher.is_terminated()
    matcher.fill_vocab_mask(vocab_mask, 0)
    assert eos in allowed_ids(vocab_mask)
    assert matcher.accept_token(eos)
    assert matcher.is_terminated()


def test_disallowed_tokens_are_masked(backend, tokenizer):
    matcher = backend.compile(GrammarKey("regex", r"\d{3}-[a-z]+")).new_matcher()
    vocab_mask = allocate_vocab_mask(2, VOCAB_SIZE)
    matcher.fill_vocab_mask(vocab_mask, 1)
    assert torch.all(vocab_mask[0] == -1)  # other rows untouched
    allowed = allowed_ids(vocab_mask, 1)
    assert allowed and all(tokenizer.decode([t]).isdigit() for t in allowed)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(2, VOCAB_SIZE, generator=generator)
        apply_vocab_mask(logits, vocab_mask, rows=[1])
        assert int(logits[1].argmax()) in allowed
        assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == allowed
        assert torch.isfinite(logits[0]).all()


def test_eos_only_once_complete(backend, tokenizer, eos):
    matcher = backend.compile(GrammarKey("json_schema", NAME_SCHEMA)).new_matcher()
    vocab_mask = allocate_vocab_mask(1, VOCAB_SIZE)
    for token_id in encode(tokenizer, '{"name": "Bob"}'):
        matcher.fill_vocab_mask(vocab_mask, 0)
        assert eos not in allowed_ids(vocab_mask)
        assert not matcher.accept_token(eos)
        assert matcher.accept_token(token_id)
    matcher.fill_vocab_mask(vocab_mask, 0)
    assert allowed_ids(vocab_mask) == {eos}
    assert not matcher.accept_token(encode(tokenizer, " ")[0])
    assert matcher.accept_token(eos) and matcher.is_terminated()
    # asked one step too late: only the stop token, and nothing more is accepted
    matcher.fill_vocab_mask(vocab_mask, 0)
    assert allowed_ids(vocab_mask) == {eos}
    assert not matcher.accept_token(eos)
    assert matcher.find_jump_forward_string() == ""


def test_rollback_restores_mask(backend, tokenizer, eos):
    matcher = backend.compile(GrammarKey("json_schema", NAME_SCHEMA)).new_matcher()
    token_ids = encode(tokenizer, '{"name": "Bob"}')
    vocab_mask = allocate_vocab_mask(1, VOCAB_SIZE)
    for token_id in token_ids[:2]:
        assert matcher.accept_token(token_id)
    matcher.fill_vocab_mask(vocab_mask, 0)
    before = vocab_mask.clone()
    for token_id in token_ids[2:]:
        assert matcher.accept_token(token_id)
    assert matcher.accept_token(eos)
    matcher.rollback(len(token_ids) - 2 + 1)
    assert not matcher.is_terminated()
    matcher.fill_vocab_mask(vocab_mask, 0)
    assert torch.equal(vocab_mask, before)
    matcher.rollback(0)
    assert torch.equal(vocab_mask, before)


def test_jump_forward_string(backend, tokenizer):
    matcher = backend.compile(GrammarKey("json_schema", NAME_SCHEMA)).new_matcher()
    forced = matcher.find_jump_forward_string()
    assert forced.startswith('{"name":')
    for token_id in encode(tokenizer, forced + "Bob"):
        assert matcher.accept_token(token_id)
    assert matcher.find_jump_forward_string() == ""  # inside a free string
    assert matcher.accept_token(encode(tokenizer, '"')[0])
    assert matcher.find_jump_forward_string() == "}"


def test_json_whitespace_is_fixed(backend, tokenizer):
    """Compact separators: no free whitespace for a weak model to stall in."""
    for key in (GrammarKey("json_schema", NAME_SCHEMA), GrammarKey("json_object", "")):
        matcher = backend.compile(key).new_matcher()
        vocab_mask = allocate_vocab_mask(1, VOCAB_SIZE)
        assert matcher.accept_token(encode(tokenizer, "{")[0])
        matcher.fill_vocab_mask(vocab_mask, 0)
        allowed = allowed_ids(vocab_mask)
        assert not any(tokenizer.decode([t]).isspace() for t in allowed)


def test_structural_tag_forms():
    bare = json.loads(structural_tag_json(json.dumps(TAG["format"])))
    assert bare["type"] == "structural_tag" and bare["format"]["type"] == "tag"
    assert bare["format"]["content"]["max_whitespace_cnt"] == TAG_MAX_WHITESPACE
    legacy = json.loads(structural_tag_json(json.dumps(LEGACY_TAG)))
    assert legacy["format"]["type"] == "triggered_tags"
    assert legacy["format"]["tags"][0]["content"]["json_schema"] == json.loads(NAME_SCHEMA)
    explicit = dict(TAG, format=dict(TAG["format"], content=dict(TAG["format"]["content"], max_whitespace_cnt=1)))
    assert json.loads(structural_tag_json(json.dumps(explicit)))["format"]["content"]["max_whitespace_cnt"] == 1


@pytest.mark.parametrize(("key", "param"), INVALID, ids=[f"{k.kind}-{k.text[:16]}" for k, _ in INVALID])
def test_bad_grammar_raises_from_check_and_compile(backend, key, param):
    with pytest.raises(GrammarError) as check_error:
        XGrammarBackend.check(key)
    with pytest.raises(GrammarError) as compile_error:
        backend.compile(key)
    for error in (check_error.value, compile_error.value):
        assert error.param == param
        assert "/project/" not in error.message and error.message.strip() == error.message


def test_unsupported_kind_message():
    with pytest.raises(GrammarError, match="does not support xml"):
        XGrammarBackend.check(GrammarKey("xml", "<a/>"))


def test_factory(tokenizer, eos):
    assert backend_class("xgrammar") is XGrammarBackend
    assert backend_class("outlines").name == "outlines"  # imported lazily
    with pytest.raises(ValueError, match="unknown grammar backend"):
        backend_class("nope")
    backend = create_grammar_backend("xgrammar", tokenizer, VOCAB_SIZE + 64, [eos])
    matcher = backend.compile(GrammarKey("regex", "[0-9]+")).new_matcher()
    vocab_mask = allocate_vocab_mask(1, VOCAB_SIZE + 64)
    matcher.fill_vocab_mask(vocab_mask, 0)
    assert max(allowed_ids(vocab_mask)) < len(tokenizer)  # padded ids never allowed


def _bounded_tag(string_schema: dict) -> dict:
    schema = {"type": "object", "properties": {"s": string_schema}, "required": ["s"]}
    return {"type": "structural_tag", "format": {"type": "tag", "begin": "<call>",
                                                  "content": {"type": "json_schema", "json_schema": schema},
                                                  "end": "</call>"}}


# (key, output up to where a string's characters begin): xgrammar 0.2.9 writes a string with
# minLength/maxLength as a class that lets raw control characters in (invalid JSON).
LENGTH_BOUNDED_STRINGS = [
    (GrammarKey("json_schema", json.dumps({"type": "string", "maxLength": 3})), '"'),
    (GrammarKey("json_schema", json.dumps({"type": "string", "minLength": 1})), '"'),
    (GrammarKey("json_schema", json.dumps({"type": "array", "items": {"type": "string", "minLength": 2,
                                                                       "maxLength": 9}})), '["'),
    (GrammarKey("json_schema", json.dumps({"type": "object", "additionalProperties": {"type": "string",
                                                                                       "maxLength": 5}})), '{"a": "'),
    (GrammarKey("structural_tag", json.dumps(_bounded_tag({"type": "string", "maxLength": 4}))), '<call>{"s": "'),
]


@pytest.mark.parametrize(("key", "prefix"), LENGTH_BOUNDED_STRINGS, ids=[k.text[:40] for k, _ in LENGTH_BOUNDED_STRINGS])
def test_no_raw_control_character_in_a_length_bounded_string(backend, tokenizer, eos, key, prefix):
    control = {i for i in range(len(tokenizer)) if any(ord(c) < 0x20 for c in tokenizer.decode([i]))}
    tab = encode(tokenizer, "\t")
    assert len(tab) == 1 and tab[0] in control  # the vocabulary has such tokens: the check can fail
    matcher = backend.compile(key).new_matcher()
    for token_id in encode(tokenizer, prefix):
        assert matcher.accept_token(token_id)
    vocab_mask = allocate_vocab_mask(1, VOCAB_SIZE)
    matcher.fill_vocab_mask(vocab_mask, 0)
    allowed = allowed_ids(vocab_mask)
    assert allowed & set(encode(tokenizer, "ab")) and not allowed & control
    assert not matcher.accept_token(tab[0])
