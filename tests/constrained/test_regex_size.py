"""`regex_shape`: a regex's size with its counted repetitions written out, and what a DFA cannot hold."""

from __future__ import annotations

import pytest

from arborlm.constrained.regex_size import RegexShape, regex_shape

SHAPES = [
    ("abc", RegexShape(3, False)),
    ("a{0,100}", RegexShape(100, False)),
    ("a{2,}", RegexShape(2, False)),
    ("a*b+c?", RegexShape(3, False)),
    ("(ab|c){3}x*", RegexShape(10, False)),
    ("(a{0,10}){0,10}", RegexShape(100, False)),
    ('"([^"\\\\]|\\\\["\\\\/bfnrt]){0,255}"', RegexShape(2 + 3 * 255, False)),
    ("(?:ab|c)(?>cd)", RegexShape(5, False)),
    ("(?=a)b", RegexShape(2, True)),
    ("(?!a)b", RegexShape(2, True)),
    (r"(a)\1", RegexShape(2, True)),
    ("a^b", RegexShape(3, True)),
    (r"x(\bfoo){2}", RegexShape(9, True)),
    ("(a|b$)", RegexShape(3, True)),
]


@pytest.mark.parametrize(("pattern", "shape"), SHAPES, ids=[p for p, _ in SHAPES])
def test_shape(pattern, shape):
    assert regex_shape(pattern) == shape


@pytest.mark.parametrize("pattern", ["a(b", "[z-a]", r"\p{L}", "a{3,2}", "(" * 2000 + ")" * 2000])
def test_what_python_cannot_read_has_no_shape(pattern):
    assert regex_shape(pattern) is None
