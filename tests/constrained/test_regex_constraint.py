"""A regex constraint means what Python's ``re.fullmatch`` says: ``.`` is no newline.

`dot_as_class` spells ``.`` out for the backends (xgrammar's ``.`` matched any
character, so ``^(|.*)$`` let a model write newlines); `validate_regex_output`
is the final check of every regex-constrained output the grammar ended.
"""

from __future__ import annotations

import re

import pytest
import torch

from arborlm.constrained.base import GrammarKey, allocate_vocab_mask
from arborlm.constrained.outlines_backend import OutlinesBackend
from arborlm.constrained.regex_constraint import RegexDialect, dot_as_class, validate_regex_output
from arborlm.constrained.xgrammar_backend import XGrammarBackend

PY = RegexDialect.PYTHON.value
ECMA = RegexDialect.ECMA.value
VOCAB_SIZE = 49152

DOTS = [  # (regex, dialect, rewritten)
    (".", RegexDialect.PYTHON, PY),
    ("^(|.*)$", RegexDialect.PYTHON, f"^(|{PY}*)$"),
    ("a.b", RegexDialect.ECMA, f"a{ECMA}b"),
    (r"\.", RegexDialect.PYTHON, r"\."),  # an escaped dot is literal
    (r"\\.", RegexDialect.PYTHON, r"\\" + PY),  # an escaped backslash, then any character
    ("[.]", RegexDialect.PYTHON, "[.]"),  # a dot in a class is literal
    ("[^.a]x.", RegexDialect.PYTHON, f"[^.a]x{PY}"),
    ("[].]", RegexDialect.PYTHON, "[].]"),  # "]" first in a class is literal
    (r"[\].].", RegexDialect.PYTHON, rf"[\].]{PY}"),
    ("(?s).+", RegexDialect.PYTHON, "(?s).+"),  # DOTALL: "." matches every character
    ("(?is)a.", RegexDialect.PYTHON, "(?is)a."),
    ("(?i)a.", RegexDialect.PYTHON, f"(?i)a{PY}"),
    ("(?s:.)+.", RegexDialect.PYTHON, f"(?s:.)+{PY}"),  # DOTALL only inside its group
    ("(?s:(a.)|(?-s:.))", RegexDialect.PYTHON, f"(?s:(a.)|(?-s:{PY}))"),
    ("(?:.)(?P<n>.)(?=.)", RegexDialect.PYTHON, f"(?:{PY})(?P<n>{PY})(?={PY})"),
    ("a{1,2}.", RegexDialect.PYTHON, f"a{{1,2}}{PY}"),
    ("[a", RegexDialect.PYTHON, "[a"),  # unclosed: left for the backend to refuse
]


@pytest.mark.parametrize(("regex", "dialect", "expected"), DOTS, ids=[d[0] for d in DOTS])
def test_dot_as_class(regex, dialect, expected):
    assert dot_as_class(regex, dialect) == expected


@pytest.mark.parametrize(("regex", "dialect", "expected"), DOTS[:-1], ids=[d[0] for d in DOTS[:-1]])
def test_rewrite_keeps_the_meaning_but_for_line_ends(regex, dialect, expected):
    """Without line ends the rewritten regex matches what the original does; with them, never more."""
    rewritten = re.compile(expected)
    for text in ("a", ".", "ab", "a.", "]x.", "\\x", "aaa"):
        assert (rewritten.fullmatch(text) is None) == (re.fullmatch(regex, text) is None), text
    for text in ("\n", "a\n", "\r", "a\u2028"):
        assert rewritten.fullmatch(text) is None or re.fullmatch(regex, text) is not None, text


VALIDATIONS = [  # (regex, text, valid)
    (r"\d{3}", "123", True),
    (r"\d{3}", "12", False),
    ("^(|.*)$", "one line", True),
    ("^(|.*)$", "two\nlines", False),
    ("(?s:.)+", "two\nlines", True),
    ("abc", "xabcx", False),  # a full match, not a search
    (r"\p{L}+", "abc", True),  # Rust / `regex` syntax that `re` lacks still validates
    (r"\x{41}", "B", True),  # ... and what Python cannot read is left to the grammar
]


@pytest.mark.parametrize(("regex", "text", "valid"), VALIDATIONS)
def test_validate_regex_output(regex, text, valid):
    problem = validate_regex_output(regex, text)
    assert (problem is None) == valid, problem


def test_validation_of_a_backtracking_regex_is_bounded():
    problem = validate_regex_output(r"(a|aa)+$", "a" * 40 + "!")
    assert problem is not None and "within" in problem


@pytest.fixture(scope="module")
def backends(tokenizer, eos):
    return {"xgrammar": XGrammarBackend(tokenizer, VOCAB_SIZE, [eos]), "outlines": OutlinesBackend(tokenizer, VOCAB_SIZE, [eos])}


def allowed_ids(matcher) -> set[int]:
    mask = allocate_vocab_mask(1, VOCAB_SIZE)
    matcher.fill_vocab_mask(mask, 0)
    bits = (mask[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
    return set(bits.flatten().nonzero().flatten().tolist())


@pytest.mark.parametrize("backend_name", ["xgrammar", "outlines"])
def test_dot_never_allows_a_newline(backends, tokenizer, backend_name):
    matcher = backends[backend_name].compile(GrammarKey("regex", "^(|.*)$")).new_matcher()
    allowed = allowed_ids(matcher)
    newline_tokens = {i for t, i in tokenizer.get_vocab().items() if "\n" in tokenizer.convert_tokens_to_string([t])}
    assert newline_tokens and not allowed & newline_tokens
    assert tokenizer.convert_tokens_to_ids("hello") in allowed


def test_dotall_group_still_allows_a_newline(backends, tokenizer):
    """outlines-core reads inline flags (xgrammar refuses them): DOTALL keeps its meaning."""
    matcher = backends["outlines"].compile(GrammarKey("regex", "(?s:.)+")).new_matcher()
    assert tokenizer.encode("\n")[0] in allowed_ids(matcher)
