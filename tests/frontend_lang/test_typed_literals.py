"""Typed gens stay whole literals when `max_new_tokens` cuts them (SGLang's test_decode_json builds a
JSON object from `gen_string()` / `gen_int()` pieces and parses it), and int gens can end."""

from __future__ import annotations

import json
import re

import pytest

import arborlm as sgl
from arborlm.frontend_lang.literals import DTYPE_REGEX, INT_END, complete_literal
from tests.frontend_lang.test_sglang_surface import Fake


@sgl.function
def decode_json(s):
    s += "Generate a JSON object to describe the basic city information of Paris.\n"
    with s.var_scope("json_output"):
        s += "{\n"
        s += '  "name": ' + sgl.gen_string() + ",\n"
        s += '  "population": ' + sgl.gen_int() + ",\n"
        s += '  "country": ' + sgl.gen(dtype=str) + "\n"
        s += "}"


# What a grammar-constrained generation cut by the length limit can look like: a literal's prefix.
CUT_STRINGS = ['"Paris, the capit', '"ends in a backslash \\', '"half an escape \\u00', '"', '',
               '"two backslashes \\\\', '"whole"']


@pytest.mark.parametrize("cut", CUT_STRINGS)
def test_a_cut_string_literal_is_closed_into_valid_json(cut):
    closed = cut + complete_literal(str, cut)
    assert re.fullmatch(DTYPE_REGEX[str], closed)
    assert isinstance(json.loads(closed), str) and closed.startswith(cut)  # only appended to
    assert complete_literal(str, closed) == ""


@pytest.mark.parametrize("stream", [False, True])
def test_decode_json_cut_by_length_still_parses(stream):
    backend = Fake('"Paris, the capit', "2100000", '"France \\', finish="length")
    state = decode_json.run(backend=backend, max_new_tokens=4, stream=stream)
    state.sync()
    obj = json.loads(state["json_output"])
    assert obj == {"name": "Paris, the capit", "population": 2100000, "country": "France \\"}
    assert state.text().endswith(state["json_output"])


def test_int_and_float_prefixes_are_completed():
    assert [t + complete_literal(int, t) for t in ("", "-", "12")] == ["0", "-0", "12"]
    assert float("3." + complete_literal(float, "3.")) == 3.0


def test_int_gen_can_end_after_a_digit():
    """The regex lets one terminator follow the digits and the same characters are stop strings,
    so the runtime stops at the first non-digit the model writes and trims it."""
    gen = sgl.gen_int("n", stop="\n\n")
    assert set(INT_END) <= set(gen.sampling["stop"]) and "\n\n" in gen.sampling["stop"]
    regex = gen.sampling["regex"]
    assert all(re.fullmatch(regex, "24" + end) for end in INT_END)
    assert re.fullmatch(regex, "24") and not re.fullmatch(regex, "24,,")
    assert "." not in sgl.gen("f", dtype=float).sampling["stop"]  # 3.5 must not stop at "."
    # A backend that keeps the stop string: the variable still holds the number only.
    state = decode_json.run(backend=Fake('"x"', "24,", '"y"'))
    assert json.loads(state["json_output"])["population"] == 24

