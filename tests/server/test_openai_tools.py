"""Tool calls on `/v1/chat/completions`, driven by the official `openai` client.

Runs on the folder's shared tiny-model server (conftest.py). The random model
writes no tool call of its own accord, so `auto` answers text here; forced calls
(`required`, a named function) must come back as calls whose arguments
validate against the function's schema, streamed or not.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from arborlm.entrypoints.openai.tool_parsers.hermes import CALL_END, call_begin
from tests.server.conftest import API_KEY

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "metric": {"type": "boolean"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
ALERT_SCHEMA = {"type": "object", "properties": {"level": {"enum": ["low", "high"]}}, "required": ["level"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city",
                                      "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "raise_alert", "parameters": ALERT_SCHEMA}},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "raise_alert": ALERT_SCHEMA}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
GREEDY = {"temperature": 0, "max_tokens": 60}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _check_calls(tool_calls, names=SCHEMAS) -> None:
    """Every call has an id, a known name and arguments that validate against its schema."""
    for call in tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(client, **kwargs) -> tuple[str, dict[int, dict], str]:
    """(content, calls by index as {id, name, arguments}, finish_reason) gathered from a stream."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            if delta.id is not None:  # the first delta of a call: id, type and name
                assert delta.index not in calls and delta.type == "function"
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                assert delta.function.arguments == ""
            else:
                assert delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments
        reason = choice.finish_reason or reason
    return content, calls, reason


@pytest.mark.usefixtures("http")
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "raise_alert"}}],
                         ids=["required", "named"])
def test_forced_calls_validate_streamed_or_not(client, tool_choice):
    kwargs = dict(model="default", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                  parallel_tool_calls=False, **GREEDY)
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls)
    if isinstance(tool_choice, dict):
        assert choice.message.tool_calls[0].function.name == "raise_alert"
    content, calls, reason = _streamed(client, **kwargs)
    assert content == "" and reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


@pytest.mark.usefixtures("http")
def test_required_with_parallel_calls(client):
    out = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         temperature=0, max_tokens=120)
    choice = out.choices[0]
    assert choice.message.tool_calls
    assert choice.finish_reason in ("tool_calls", "length")
    _check_calls(choice.message.tool_calls)  # a call cut by max_tokens is not among them


@pytest.mark.usefixtures("http")
def test_call_cut_by_max_tokens_streamed_or_not(client):
    kwargs = dict(model="default", messages=MESSAGES, tools=TOOLS, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    full = client.chat.completions.create(max_tokens=60, logprobs=True, **kwargs)
    arguments = full.choices[0].message.tool_calls[0].function.arguments
    begin, end = call_begin("get_weather"), call_begin("get_weather") + arguments
    prefixes = ["".join(t.token for t in full.choices[0].logprobs.content[:k])
                for k in range(1, len(full.choices[0].logprobs.content))]
    assert "".join(t.token for t in full.choices[0].logprobs.content).startswith(end + CALL_END)
    cuts = {  # max_tokens -> where the output is cut
        "header": max(k for k, p in enumerate(prefixes, 1) if len(p) < len(begin) - 1),
        "arguments": max(k for k, p in enumerate(prefixes, 1) if len(begin) < len(p) < len(end)),
        "end marker": max(k for k, p in enumerate(prefixes, 1) if len(end) <= len(p)),
    }
    for where, max_tokens in cuts.items():
        out = client.chat.completions.create(max_tokens=max_tokens, **kwargs)
        choice = out.choices[0]
        assert choice.finish_reason == "length", where
        assert choice.message.content == ("" if where != "end marker" else None), where  # never the call's markup
        content, calls, reason = _streamed(client, max_tokens=max_tokens, **kwargs)
        assert reason == "length" and content == "", where
        streamed = calls[0]["arguments"] if calls else ""
        assert "</tool" not in streamed and arguments.startswith(streamed), where
        if where == "end marker":  # the arguments were whole: the call, without the cut end marker
            assert [c.function.arguments for c in choice.message.tool_calls] == [arguments] == [streamed]
        else:  # a half-parsed call is no call (streamed, its argument deltas were already sent)
            assert choice.message.tool_calls is None, where


@pytest.mark.usefixtures("http")
def test_auto_answers_text_or_valid_calls(client):
    for parallel in (True, False):
        out = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                             parallel_tool_calls=parallel, temperature=0, max_tokens=16)
        choice = out.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            assert parallel or len(choice.message.tool_calls) == 1
            _check_calls(choice.message.tool_calls)
        else:
            assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    default = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, **GREEDY)
    assert default.choices[0].message.content is not None or default.choices[0].message.tool_calls


@pytest.mark.usefixtures("http")
def test_tool_choice_none_is_plain_text(client):
    out = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                         temperature=0, max_tokens=8)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.usefixtures("http")
def test_history_with_tool_calls_and_results(client, tiny_tokenizer):
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny"}'},
    ]
    out = client.chat.completions.create(model="default", messages=history, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, **GREEDY)
    _check_calls(out.choices[0].message.tool_calls)
    text = client.chat.completions.create(model="default", messages=history, temperature=0, max_tokens=4)
    assert text.choices[0].message.content is not None
    # SmolLM2's template has no tool support: the call and its result are written in the documented format
    rendered = [*MESSAGES,
                {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                 '{"city": "Paris", "days": 3}}\n</tool_call>'},
                {"role": "tool", "content": '<tool_response>\n{"forecast": "sunny"}\n</tool_response>'}]
    prompt = tiny_tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
    assert text.usage.prompt_tokens == len(tiny_tokenizer.encode(prompt, add_special_tokens=False))
    assert out.usage.prompt_tokens > text.usage.prompt_tokens  # the tools are described only when offered
    # the client's own message object goes back into the history unchanged
    call = out.choices[0].message.tool_calls[0]
    again = client.chat.completions.create(
        model="default", temperature=0, max_tokens=4, tools=TOOLS,
        messages=[*history, out.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "ok"}])
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


BAD_TOOL_REQUESTS = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["x"]}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}}]}, "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "g", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
]


@pytest.mark.parametrize("fields, param", BAD_TOOL_REQUESTS, ids=[p for _, p in BAD_TOOL_REQUESTS])
def test_bad_tools_get_400_naming_the_field(http, fields, param):
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 4, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert http.get("/health").status_code == 200
