"""Every tool-call format: its parser over every chunking of its text (hypothesis), and its grammar
accepting what the parser reads and refusing invalid arguments; no server.

Outputs are generated as the grammar lets a model write them in `auto` mode: content, calls in
the format's text, content between them. Known upstream bug classes are in the examples:
several calls in one streamed increment (a single chunk), a call with empty arguments followed
by another, markup split across chunks (every split point).
"""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from arborlm.chat_template import load_chat_template
from arborlm.constrained.xgrammar_backend import structural_tag_json
from arborlm.entrypoints.openai.tool_parsers.base import (
    ArgumentsDelta,
    CallStart,
    FunctionSpec,
    TextDelta,
    ToolCallFormat,
    parse_whole,
)
from arborlm.entrypoints.openai.tool_parsers.hermes import HermesFormat
from arborlm.entrypoints.openai.tool_parsers.llama3 import Llama3Format
from arborlm.entrypoints.openai.tool_parsers.mistral import MistralFormat
from arborlm.entrypoints.openai.tool_parsers.pythonic import PythonicFormat, kwargs_to_json
from arborlm.entrypoints.openai.tool_parsers.registry import tool_call_format

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "metric": {"type": "boolean"}, "note": {"type": ["string", "null"]}},
           "required": ["city"], "additionalProperties": False}
NOOP = {"type": "object", "properties": {}, "additionalProperties": False}
FUNCTIONS = [FunctionSpec("get_weather", WEATHER), FunctionSpec("noop", NOOP)]
NAMES = [f.name for f in FUNCTIONS]

FORMATS = {
    "hermes": HermesFormat(),
    "llama3": Llama3Format(),
    "llama3-python-tag": Llama3Format(python_tag=True),
    "mistral": MistralFormat(),
    "pythonic": PythonicFormat(),
}

# Arguments: what each function accepts (strings with quotes, escapes, braces, brackets and markup).
tricky_text = st.lists(st.sampled_from(list('ab "\\{}[]()<>/;,=\n') + ["</tool_call>", "[TOOL_CALLS]", "é", "😀"]),
                       max_size=8).map("".join)
weather_args = st.fixed_dictionaries({"city": tricky_text}, optional={
    "days": st.integers(-5, 10**6), "metric": st.booleans(), "note": st.none() | tricky_text})
calls = st.lists(st.one_of(st.tuples(st.just("get_weather"), weather_args), st.tuples(st.just("noop"), st.just({}))),
                 min_size=0, max_size=3)
# Content around calls: plain words (content text cannot hold call markup: the grammar makes it a call).
content = st.text(st.sampled_from(list("Hi there.\n ")), max_size=10)


def ordered(name: str, arguments: dict) -> dict:
    """`arguments` in the schema's property order (the order the grammar writes them in)."""
    order = list(WEATHER["properties"]) if name == "get_weather" else []
    return {k: arguments[k] for k in order if k in arguments}


def write(fmt: ToolCallFormat, before: str, made: list[tuple[str, dict]], after: str) -> str:
    """An `auto` answer: content, the calls in the format's text, content."""
    text = fmt.history_text([(n, ordered(n, a)) for n, a in made]) if made else ""
    if isinstance(fmt, Llama3Format) and fmt.python_tag and made:
        text = "<|python_tag|>" + text
    return before + (" " if before and made else "") + text + after


def joined(events) -> tuple[str, list[tuple[int, str, str]]]:
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    starts = [(e.index, e.id, e.name) for e in events if isinstance(e, CallStart)]
    args = {i: "".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == i)
            for i, _, _ in starts}
    return text, [(i, name, args[i]) for i, _, name in starts]


def fed(fmt: ToolCallFormat, text: str, cuts: list[int]):
    parser = fmt.new_parser(NAMES)
    events, last = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    return parser, events + parser.finish()


@pytest.mark.parametrize("name", FORMATS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=content, made=calls, after=content, data=st.data())
@example(before="", made=[("noop", {}), ("get_weather", {"city": "x"})], after="", data=None)
@example(before="Hi", made=[("get_weather", {"city": "}\n</tool_call>"}), ("noop", {})], after="", data=None)
def test_every_chunking_reads_the_calls_written(name, before, made, after, data):
    fmt = FORMATS[name]
    text = write(fmt, before, made, after)
    whole = parse_whole(fmt, text, NAMES)
    assert [(c.name, json.loads(c.arguments), c.complete) for c in whole.calls] == [
        (n, ordered(n, a), True) for n, a in made]
    markup = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '{"name"', "[get_weather(", "[noop(")
    assert not any(m in (whole.content or "") for m in markup)
    one_chunk = [] if data is None else data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    for cuts in (one_chunk, list(range(len(text)))):  # some chunking, and one character at a time
        parser, events = fed(fmt, text, cuts)
        assert joined(events) == (whole.content or "", [(i, c.name, c.arguments) for i, c in enumerate(whole.calls)])
        assert [(c.name, c.arguments, c.complete) for c in parser.calls] == [
            (c.name, c.arguments, c.complete) for c in whole.calls]
        assert parser.content == whole.content


@pytest.mark.parametrize("name", FORMATS)
@settings(max_examples=60, deadline=None)
@given(made=calls.filter(bool), cut=st.integers(0, 10**6), data=st.data())
def test_a_cut_output_streams_what_it_parses(name, made, cut, data):
    """Cut anywhere (max_tokens): streamed or whole, the same content and calls, and no markup as content
    but for an unfinished trigger at the very end (text until it is one, as a trigger-free answer's `<`)."""
    fmt = FORMATS[name]
    text = write(fmt, "", made, "")
    text = text[:cut % (len(text) + 1)]
    whole = parse_whole(fmt, text, NAMES)
    parser, events = fed(fmt, text, data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    assert joined(events) == (whole.content or "", [(i, c.name, c.arguments) for i, c in enumerate(whole.calls)])
    triggers = fmt.new_parser(NAMES).syntax.triggers
    assert any(t.startswith((whole.content or "").strip()) for t in triggers), (text, whole.content)
    for call in whole.calls:
        if call.complete:
            json.loads(call.arguments)


def _grammar(fmt: ToolCallFormat, choice: str, parallel: bool = True, named: str | None = None) -> xgr.Grammar:
    tag = {"type": "structural_tag", "format": fmt.structural_tag(FUNCTIONS, choice, parallel, named)}
    return xgr.Grammar.from_structural_tag(structural_tag_json(json.dumps(tag)))


def _accepts(grammar: xgr.Grammar, text: str) -> bool:
    return xgr.testing._is_grammar_accept_string(grammar, text)


GOOD = [("get_weather", {"city": "Paris", "days": 3, "metric": True, "note": None}), ("noop", {})]
BAD = [("get_weather", {"days": 3}), ("get_weather", {"city": "Paris", "days": "3"}),
       ("get_weather", {"city": "Paris", "extra": 1}), ("noop", {"x": 1})]


@pytest.mark.parametrize("name", FORMATS)
def test_grammar_accepts_valid_calls_and_refuses_invalid_arguments(name):
    fmt = FORMATS[name]
    tagged = isinstance(fmt, Llama3Format) and fmt.python_tag

    def forced(made):  # forced modes write <|python_tag|> where the template has it
        text = fmt.history_text(made)
        return "<|python_tag|>" + text.replace("; ", "; <|python_tag|>") if tagged else text

    required, auto = _grammar(fmt, "required"), _grammar(fmt, "auto")
    assert _accepts(required, forced(GOOD)) and _accepts(auto, "Sure. " + write(fmt, "", GOOD, ""))
    assert _accepts(_grammar(fmt, "named", named="noop"), forced([GOOD[1]]))
    assert not _accepts(_grammar(fmt, "named", named="noop"), forced([GOOD[0]]))
    assert not _accepts(_grammar(fmt, "required", parallel=False), forced(GOOD))
    assert _accepts(auto, "Just text, no call.")
    assert not _accepts(required, "Just text, no call.")
    for made in BAD:
        assert not _accepts(required, forced([made])), made
        assert not _accepts(auto, "Sure. " + forced([made])), made


@pytest.mark.parametrize("template, expected", [
    ("chatml", "hermes"), ("qwen3", "hermes"), ("llama-3-instruct", "llama3"), ("llama-3-pythonic", "pythonic"),
    ("mistral", "mistral"), ("deepseek-r1", "hermes"),
])
def test_format_is_detected_from_the_template(template, expected):
    fmt = tool_call_format(None, load_chat_template(template))
    assert fmt.name == expected
    assert fmt.renders_natively(load_chat_template(template)) == (template != "deepseek-r1")
    assert tool_call_format("mistral", load_chat_template(template)).name == "mistral"
    assert tool_call_format("qwen25", None).name == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser"):
        tool_call_format("nope", None)


def test_llama3_python_tag_follows_the_template():
    assert tool_call_format(None, load_chat_template("llama-3-instruct")).python_tag is True
    assert Llama3Format.from_template('"parameters": ').python_tag is False


@pytest.mark.parametrize("kwargs, expected", [
    ('city="Paris", days=3', {"city": "Paris", "days": 3}),
    ("a=True, b=None, c=[1, {\"k\": False}]", {"a": True, "b": None, "c": [1, {"k": False}]}),
    ("a=true, b=null", {"a": True, "b": None}),
    ("s='single', t=\"\\u00e9\\ud83d\\ude00\"", {"s": "single", "t": "é😀"}),
    ("", {}),
])
def test_pythonic_arguments_become_json(kwargs, expected):
    assert json.loads(kwargs_to_json(kwargs)) == expected


@pytest.mark.parametrize("kwargs", ["1, 2", "a=f(1)", "**x", "a=", "a=1,, b=2"])
def test_pythonic_non_literal_arguments_stay_text(kwargs):
    assert kwargs_to_json(kwargs) == kwargs


def test_pythonic_refuses_property_names_that_are_not_identifiers():
    from arborlm.constrained.keys import GrammarError

    bad = FunctionSpec("f", {"type": "object", "properties": {"first-name": {"type": "string"}}})
    with pytest.raises(GrammarError, match="first-name"):
        PythonicFormat().structural_tag([bad], "auto", True)
