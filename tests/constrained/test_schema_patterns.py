"""json_schema.patterns.separator_first_repeat: an exact rewrite xgrammar fills masks for quickly."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from arborlm.constrained.json_schema import prepare_json_schema
from arborlm.constrained.json_schema.patterns import separator_first_repeat

WORDS = r"^(?:\S+\s+){0,199}\S+$"


@pytest.mark.parametrize("pattern,expected", [
    (WORDS, r"^\S+(?:\s+\S+){0,199}$"),
    (r"^(?:[a-z]+-){1,500}[a-z]+$", r"^[a-z]+(?:-[a-z]+){1,500}$"),
    (r"^(?:\S+\s+){2,}\S+$", r"^\S+(?:\s+\S+){2,}$"),  # no upper bound
    (r"^(?:\S+\s+){0,99}\S+$", None),  # xgrammar expands a bound this small: fast already
    (r"^(?:\S+\s+){0,199}\S$", None),  # A would end inside an atom (\S of \S+)
    (r"^(?:a|b-){0,300}a$", None),  # an alternation in the group
    (r"^(?:\S+\s+){0,199}?\S+$", None),  # lazy
    (r"^(?:ab){0,300}c$", None),  # the tail is not the group's head
    (r"^\S+$", None),
])
def test_separator_first_repeat(pattern, expected):
    assert separator_first_repeat(pattern) == (pattern if expected is None else expected)


def test_rewrite_keeps_the_language():
    small = (r"^(?:\S+\s+){0,3}\S+$", r"^\S+(?:\s+\S+){0,3}$")  # the identity at a checkable bound
    for n in range(1, 7):
        for chars in itertools.product("a -", repeat=n):
            text = "".join(chars)
            assert bool(re.fullmatch(small[0], text)) == bool(re.fullmatch(small[1], text)), text


def test_json_schema_patterns_are_rewritten():
    prepared = prepare_json_schema({"type": "string", "minLength": 1, "pattern": WORDS})
    assert json.loads(prepared.text)["pattern"] == r"^\S+(?:\s+\S+){0,199}$"
    assert json.loads(prepared.original)["pattern"] == WORDS  # outputs are validated against the user's
