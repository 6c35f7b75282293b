"""xgrammar and outlines-core agree on which outputs a regex or a simple JSON schema allows.

Both backends are driven over the same SmolLM2 token ids. JSON candidates are
written as ``json.dumps`` writes them (``", "`` and ``": "``): xgrammar allows
exactly that whitespace, outlines-core (``[ ]?`` per gap) allows it among others.
Where the two differ on purpose or by a library's choice the difference is
pinned in `KNOWN_DIFFERENCES`, so that a library upgrade that changes it shows.
"""

from __future__ import annotations

import json

import pytest
import torch

from arborlm.constrained.base import GrammarKey, allocate_vocab_mask
from arborlm.constrained.outlines_backend import OutlinesBackend
from arborlm.constrained.xgrammar_backend import XGrammarBackend

VOCAB_SIZE = 49152
COMPLETE, INCOMPLETE, REJECTED = "complete", "incomplete", "rejected"
NAME_AGE = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"]}
ID_TAGS = {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
           "required": ["id"]}
TWO_INTS = {"type": "array", "items": {"type": "integer"}, "maxItems": 2}
DATE = r"\d{4}-\d{2}-\d{2}"
EMAIL = r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}"
NUMBER = r"-?\d+(\.\d+)?"


def regex(text: str) -> GrammarKey:
    return GrammarKey("regex", text)


def schema(value) -> GrammarKey:
    return GrammarKey("json_schema", json.dumps(value))


# (key, candidate output, what both backends make of it)
AGREE = [
    (regex(DATE), "2024-01-31", COMPLETE),
    (regex(DATE), "2024-01-3", INCOMPLETE),
    (regex(DATE), "2024-1-31", REJECTED),
    (regex(DATE), "2024-01-311", REJECTED),
    (regex(DATE), "٢٠٢٤-01-31", REJECTED),  # \d is ASCII in both
    (regex(EMAIL), "bob.smith@example.com", COMPLETE),
    (regex(EMAIL), "bob@example", INCOMPLETE),
    (regex(EMAIL), "bob@@example.com", REJECTED),
    (regex(EMAIL), "Bob@example.com", REJECTED),
    (regex(r"(cat|category|dog)s?"), "category", COMPLETE),
    (regex(r"(cat|category|dog)s?"), "cats", COMPLETE),
    (regex(r"(cat|category|dog)s?"), "categ", INCOMPLETE),
    (regex(r"(cat|category|dog)s?"), "catx", REJECTED),
    (regex(r"(a|ab)c?"), "abc", COMPLETE),
    (regex(r"(a|ab)c?"), "ac", COMPLETE),
    (regex(r"(a|ab)c?"), "abb", REJECTED),
    (regex(r"(yes|no)"), "yes", COMPLETE),
    (regex(r"(yes|no)"), "y", INCOMPLETE),
    (regex(r"(yes|no)"), "yesno", REJECTED),
    (regex(NUMBER), "3.14", COMPLETE),
    (regex(NUMBER), "-0.5", COMPLETE),
    (regex(NUMBER), "3.", INCOMPLETE),
    (regex(NUMBER), "3..1", REJECTED),
    (regex(r"\w+"), "hello_42", COMPLETE),
    (regex(r"\w+"), "héllo", REJECTED),  # \w is ASCII in both
    (regex(r"[\u4e00-\u9fff]+"), "日本語", COMPLETE),
    (regex(r"[\u4e00-\u9fff]+"), "日本a", REJECTED),
    (regex(r"[^,]+,[^,]+"), "é✓,x", COMPLETE),
    (regex(r"[^,]+,[^,]+"), "a,b,c", REJECTED),
    (regex(r"a{2,3}"), "aaa", COMPLETE),
    (regex(r"a{2,3}"), "a", INCOMPLETE),
    (regex(r"a{2,3}"), "aaaa", REJECTED),
    (regex(r"a.b"), "axb", COMPLETE),
    (regex(r"a.b"), "a\nb", REJECTED),  # "." is Python's in both: no newline (regex_constraint)
    (schema(NAME_AGE), '{"name": "Bob", "age": 42}', COMPLETE),
    (schema(NAME_AGE), '{"name": "Bo\\"b", "age": -7}', COMPLETE),
    (schema(NAME_AGE), '{"name": "Bob", "age": 4', INCOMPLETE),
    (schema(NAME_AGE), '{"name": "Bob"}', REJECTED),  # age is required
    (schema(NAME_AGE), '{"age": 42, "name": "Bob"}', REJECTED),  # properties in schema order
    (schema(NAME_AGE), '{"name": "Bob", "age": "42"}', REJECTED),
    (schema(NAME_AGE), '{"name": "Bob", "age": 42, "x": 1}', REJECTED),
    (schema(NAME_AGE), '{"name": "Bob", "age": 042}', REJECTED),
    (schema(NAME_AGE), '{"name": "tab\there", "age": 1}', REJECTED),  # raw control character
    (schema(NAME_AGE), '{"name": "Bob", "age": 42} ', REJECTED),
    (schema(ID_TAGS), '{"id": 1, "tags": ["a", "b"]}', COMPLETE),
    (schema(ID_TAGS), '{"id": 1}', COMPLETE),
    (schema(ID_TAGS), '{"tags": []}', REJECTED),
    (schema(TWO_INTS), "[1, 2]", COMPLETE),
    (schema(TWO_INTS), "[]", COMPLETE),
    (schema(TWO_INTS), "[1, 2, 3]", REJECTED),
    (schema({"enum": ["red", "green", 3, None]}), '"green"', COMPLETE),
    (schema({"enum": ["red", "green", 3, None]}), "null", COMPLETE),
    (schema({"enum": ["red", "green", 3, None]}), '"blue"', REJECTED),
    (schema({"type": "number"}), "1.5E+3", COMPLETE),
    (schema({"type": "number"}), ".5", REJECTED),
    (schema({"type": "integer"}), "-" + "9" * 19, COMPLETE),
    (schema({"type": "integer"}), "9" * 20, REJECTED),  # at most an int64's digits (number_bounds)
    (schema({"type": "number"}), "0." + "5" * 18, REJECTED),
    (schema({"type": "string", "minLength": 2, "maxLength": 3}), '"ab"', COMPLETE),
    (schema({"type": "string", "minLength": 2, "maxLength": 3}), '"abcd"', REJECTED),
    (schema({"type": "string", "pattern": "^[A-Z]{3}$"}), '"ABC"', COMPLETE),
    (schema({"type": "string", "pattern": "^[A-Z]{3}$"}), '"ABCD"', REJECTED),
    (schema({"type": "string", "format": "date"}), '"2024-01-31"', COMPLETE),
    (schema({"type": "string", "format": "date"}), '"2024-13-01"', REJECTED),
    (schema({"anyOf": [{"type": "integer"}, {"type": "null"}]}), "null", COMPLETE),
    (schema({"type": "object", "additionalProperties": {"type": "integer"}}), '{"a": 1, "b": 2}', COMPLETE),
]

# (key, candidate, xgrammar's outcome, outlines-core's outcome): differences we know and keep.
KNOWN_DIFFERENCES = [
    # Whitespace: xgrammar writes json.dumps's separators exactly; outlines allows [ ]? per gap.
    (schema(NAME_AGE), '{"name":"Bob", "age": 42}', REJECTED, COMPLETE),
    (schema(TWO_INTS), "[ ]", REJECTED, COMPLETE),
    # outlines-core's JSON string allows only the one-character escapes, not \uXXXX.
    (schema(NAME_AGE), '{"name": "Jos\\u00e9", "age": 42}', COMPLETE, REJECTED),
    # outlines-core's JSON number needs a sign after the exponent.
    (schema({"type": "number"}), "1e5", COMPLETE, REJECTED),
    # xgrammar's JSON integer leaves out -0 (valid JSON).
    (schema(NAME_AGE), '{"name": "Bob", "age": -0}', REJECTED, COMPLETE),
]

# Regexes whose token masks must match step by step along a valid output.
SAME_MASKS = [
    (regex(DATE), "2024-01-31"),
    (regex(EMAIL), "a.b@x.org"),
    (regex(r"(a|ab)c?"), "abc"),
    (regex(NUMBER), "-3.14"),
    (regex(r"(yes|no|maybe)"), "maybe"),
    (regex(r"[^\"]{0,3}x"), "é✓x"),
]


@pytest.fixture(scope="module")
def backends(tokenizer, eos) -> dict:
    return {
        "xgrammar": XGrammarBackend(tokenizer, VOCAB_SIZE, [eos], max_threads=2),
        "outlines": OutlinesBackend(tokenizer, VOCAB_SIZE, [eos]),
    }


@pytest.fixture(scope="module")
def new_matcher(backends):
    """A fresh matcher of backend ``name`` for ``key`` (grammars compiled once per module)."""
    compiled = {}

    def new_matcher(name: str, key: GrammarKey):
        if (name, key) not in compiled:
            compiled[name, key] = backends[name].compile(key)
        return compiled[name, key].new_matcher()

    return new_matcher


def outcome(matcher, token_ids: list[int], eos: int) -> str:
    """Accept ``token_ids`` until one is rejected; then say whether EOS may end the output."""
    for token_id in token_ids:
        if not matcher.accept_token(token_id):
            return REJECTED
    return COMPLETE if matcher.accept_token(eos) else INCOMPLETE


def allowed_ids(matcher) -> set[int]:
    vocab_mask = allocate_vocab_mask(1, VOCAB_SIZE)
    matcher.fill_vocab_mask(vocab_mask, 0)
    bits = (vocab_mask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1  # (V/32, 32)
    return set(bits.flatten().nonzero().flatten().tolist())


def case_id(key: GrammarKey, text: str) -> str:
    return f"{key.kind}:{key.text[:30]}|{text}"


@pytest.mark.parametrize(("key", "text", "expected"), AGREE, ids=[case_id(k, t) for k, t, _ in AGREE])
def test_backends_agree_on_validity(tokenizer, eos, new_matcher, key, text, expected):
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    outcomes = {name: outcome(new_matcher(name, key), token_ids, eos) for name in ("xgrammar", "outlines")}
    assert outcomes == {"xgrammar": expected, "outlines": expected}


@pytest.mark.parametrize(("key", "text", "xgrammar", "outlines"), KNOWN_DIFFERENCES,
                         ids=[case_id(k, t) for k, t, _, _ in KNOWN_DIFFERENCES])
def test_known_differences_stay_as_documented(tokenizer, eos, new_matcher, key, text, xgrammar, outlines):
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    outcomes = {name: outcome(new_matcher(name, key), token_ids, eos) for name in ("xgrammar", "outlines")}
    assert outcomes == {"xgrammar": xgrammar, "outlines": outlines}


@pytest.mark.parametrize(("key", "text"), SAME_MASKS, ids=[case_id(k, t) for k, t in SAME_MASKS])
def test_backends_allow_the_same_tokens_at_every_step(tokenizer, eos, backends, new_matcher, key, text):
    # outlines leaves out the tokens holding the byte 0xF4 (U+100000..U+10FFFF), its end mark's lead byte.
    token_bytes = backends["outlines"].token_bytes
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    left_out = {i for i in range(len(tokenizer)) if token_bytes[i] is None} - special
    assert all("ô" in tokenizer.convert_ids_to_tokens(i) for i in left_out)  # "ô" is 0xF4 in byte-level BPE
    xgrammar, outlines = new_matcher("xgrammar", key), new_matcher("outlines", key)
    for token_id in [*tokenizer.encode(text, add_special_tokens=False), eos]:
        assert allowed_ids(xgrammar) - left_out == allowed_ids(outlines)
        assert xgrammar.accept_token(token_id) and outlines.accept_token(token_id)
