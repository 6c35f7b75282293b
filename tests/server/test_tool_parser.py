"""The Hermes `ToolCallParser`: the call format split into content and calls, whole or fed in pieces;
no server. (The other formats: test_tool_formats.py.)"""

from __future__ import annotations

import json
import random

import pytest

from arborlm.entrypoints.openai.protocol import ChatCompletionRequest
from arborlm.entrypoints.openai.tool_calls import delta_of, plan_tools, tool_message
from arborlm.entrypoints.openai.tool_parsers.base import (
    ArgumentsDelta,
    CallStart,
    TextDelta,
    ToolCallParser,
    parse_whole,
)
from arborlm.entrypoints.openai.tool_parsers.hermes import HermesFormat, call_begin
from arborlm.entrypoints.openai.tool_prompt import content_with_calls, with_tools_described

HERMES = HermesFormat()


def parse_tool_calls(text: str) -> ToolCallParser:
    return parse_whole(HERMES, text, [])


def block(name: str, arguments: str) -> str:
    return f"{call_begin(name)}{arguments}}}\n</tool_call>"


WEATHER = block("get_weather", '{"city": "Paris", "days": 3}')
NOOP = block("noop", "{}")

# (output text, content, [(name, arguments, complete)])
CASES = [
    ("Just text.", "Just text.", []),
    ("", "", []),
    (WEATHER, None, [("get_weather", '{"city": "Paris", "days": 3}', True)]),
    (f"Let me look.\n{WEATHER}", "Let me look.\n", [("get_weather", '{"city": "Paris", "days": 3}', True)]),
    (f"{WEATHER}\n{NOOP}", None, [("get_weather", '{"city": "Paris", "days": 3}', True), ("noop", "{}", True)]),
    (f"{WEATHER}\n", None, [("get_weather", '{"city": "Paris", "days": 3}', True)]),
    (f"{WEATHER}\nDone.", "\nDone.", [("get_weather", '{"city": "Paris", "days": 3}', True)]),
    (f"{WEATHER} and {NOOP}", " and ", [("get_weather", '{"city": "Paris", "days": 3}', True), ("noop", "{}", True)]),
    # cut off by max_tokens: the arguments without any of the end marker; complete only when whole JSON
    (call_begin("get_weather") + '{"city": "Pa', None, [("get_weather", '{"city": "Pa', False)]),
    (call_begin("get_weather"), None, [("get_weather", "", False)]),
    (call_begin("f") + '{"n": 2}', None, [("f", '{"n": 2}', True)]),
    (call_begin("f") + '{"n": 2}}\n</tool', None, [("f", '{"n": 2}', True)]),
    (call_begin("f") + '{"n": 2}}\n', None, [("f", '{"n": 2}', True)]),
    (call_begin("f") + '{"a": {"b": 1}}', None, [("f", '{"a": {"b": 1}}', True)]),
    (call_begin("f") + '{"a": {"b": 1}}}', None, [("f", '{"a": {"b": 1}}', True)]),
    (call_begin("f") + '{"a": {"b": 1}', None, [("f", '{"a": {"b": 1}', False)]),
    # cut inside the header: call markup, neither content nor a call
    ('<tool_call>\n{"name": "get_wea', "", []),
    ('Let me look.\n<tool_call>\n{"na', "Let me look.\n", []),
    ("<tool_call>", "", []),
    ('{"nested": "}\\n</tool_call> in a string"}' + WEATHER, '{"nested": "}\\n</tool_call> in a string"}',
     [("get_weather", '{"city": "Paris", "days": 3}', True)]),
    ("a <tool", "a <tool", []),
    ("<tool_call>not a call</tool_call>", "<tool_call>not a call</tool_call>", []),
    (block("f", '{"s": "a}\\n</b>"}'), None, [("f", '{"s": "a}\\n</b>"}', True)]),
]


def _summary(parser: ToolCallParser) -> tuple:
    return parser.content, [(c.name, c.arguments, c.complete) for c in parser.calls]


@pytest.mark.parametrize("text, content, calls", CASES, ids=[repr(c[0])[:40] for c in CASES])
def test_whole_output(text, content, calls):
    assert _summary(parse_tool_calls(text)) == (content, calls)


@pytest.mark.parametrize("text, content, calls", CASES, ids=[repr(c[0])[:40] for c in CASES])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fed_in_pieces_gives_the_same_events_joined(text, content, calls, seed):
    rng = random.Random(seed)
    parser = HERMES.new_parser([])
    events = []
    i = 0
    while i < len(text):
        size = rng.randint(1, 6)
        events += parser.feed(text[i:i + size])
        i += size
    events += parser.finish()
    assert _summary(parser) == (content, calls)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == (content or "")
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [(s.index, s.name) for s in starts] == [(k, c[0]) for k, c in enumerate(calls)]
    for k, (_, arguments, _) in enumerate(calls):
        assert "".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == k) == arguments
    assert len({c.id for c in parser.calls}) == len(calls)


def test_history_blocks_parse_back():
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]
    parser = parse_tool_calls(content_with_calls("", calls, HERMES))
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("get_weather", {"city": "Paris", "days": 3})]


def test_tools_go_to_the_system_message():
    tools = [{"type": "function", "function": {"name": "f"}}]
    added = with_tools_described([{"role": "user", "content": "hi"}], tools, HERMES)
    assert added[0]["role"] == "system" and '{"type": "function", "function": {"name": "f"}}' in added[0]["content"]
    joined = with_tools_described([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                                  tools, HERMES)
    assert joined[0]["content"].startswith("Be brief.\n\n# Tools") and len(joined) == 2


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}, "s": {"format": "email"}},
          "required": ["n"]}


def _plan(**fields):
    body = {"messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}], **fields}
    return plan_tools(ChatCompletionRequest.model_validate(body), "xgrammar")


@pytest.mark.parametrize("choice, fmt", [(None, "triggered_tags"), ("auto", "triggered_tags"),
                                         ("required", "tags_with_separator"),
                                         ({"type": "function", "function": {"name": "f"}}, "tag")])
def test_plan_formats(choice, fmt):
    plan = _plan(tool_choice=choice, parallel_tool_calls=False)
    tag = plan.structural_tag()["format"]
    assert tag["type"] == fmt
    if fmt != "tag":
        assert tag["stop_after_first"] is True


def test_answer_checks_arguments_and_finish_reason():
    plan = _plan(tool_choice="required")
    message, checked, reason = tool_message(plan, block("f", '{"n": 2}'), "stop")
    assert reason == "tool_calls" and message["content"] is None and checked.dropped is None
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"n": 2}'}
    assert message["tool_calls"][0]["id"].startswith("call_")
    invalid, checked, reason = tool_message(plan, block("f", '{"n": 9}'), "stop")  # what the grammar would forbid
    assert invalid["tool_calls"] is None and reason == "abort" and invalid["content"] == ""
    assert "the call of f was dropped" in checked.dropped and "/n" in checked.dropped
    assert tool_message(plan, "plain", "stop")[2] == "stop"


@pytest.mark.parametrize("text, content, arguments", [
    (call_begin("f") + '{"n"', "", None),  # arguments not JSON: no call
    ("Calling.\n" + call_begin("f") + '{"n": 2, "s": "a', "Calling.\n", None),
    ('Calling.\n<tool_call>\n{"name": "f", "argu', "Calling.\n", None),  # no markup in content
    (call_begin("f") + '{"n": 2}', None, '{"n": 2}'),  # arguments whole: the call, without the cut marker
    (call_begin("f") + '{"n": 2}}\n</tool_', None, '{"n": 2}'),
])
def test_call_cut_by_max_tokens(text, content, arguments):
    plan = _plan(tool_choice="auto")
    message, _, reason = tool_message(plan, text, "length")
    assert reason == "length" and message["content"] == content
    calls = message["tool_calls"]
    assert (calls[0]["function"]["arguments"] if calls else None) == arguments
    assert "<tool_call>" not in (message["content"] or "")


def test_stream_deltas_in_openai_shape():
    assert delta_of(CallStart(0, "call_1", "f")) == {
        "tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]}
    assert delta_of(ArgumentsDelta(1, '{"a"')) == {"tool_calls": [{"index": 1, "function": {"arguments": '{"a"'}}]}
    assert delta_of(TextDelta("hi")) == {"content": "hi"}
