"""Tool calls per family on a server with the family's chat template (`--chat-template`, the format
detected from it), driven by the official `openai` client.

The model is scripted (`scripted_model.py`): after the prompt it writes the family's trigger, so
`auto` calls a tool the way a real model of the family would, and the grammar writes the rest.
Forced calls (`required`, a named function) and `auto` calls must come back as calls whose
arguments validate against the function's schema, streamed or not, identical both ways, with no
markup in the content; the call goes back into the history, rendered by the template itself.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, start_server, stop_server, wait_idle
from tests.server.scripted_model import (
    chain,
    scripted_tokenizer,
    token_pieces,
    write_scripted_model,
)

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "metric": {"type": "boolean"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
ALERT_SCHEMA = {"type": "object", "properties": {"level": {"enum": ["low", "high"]}}, "required": ["level"],
                "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city",
                                      "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "raise_alert", "parameters": ALERT_SCHEMA}},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "raise_alert": ALERT_SCHEMA}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
GREEDY = {"temperature": 0, "max_tokens": 80}

# family -> (built-in template, the trigger the scripted model writes, markers that must stay out of content)
FAMILIES = {
    "hermes": ("chatml", "<tool_call>", ["<tool_call>", "</tool_call>"]),
    "llama3": ("llama-3-instruct", '{"name": ', ['{"name"', "<|python_tag|>"]),
    "mistral": ("mistral", "[TOOL_CALLS]", ["[TOOL_CALLS]"]),
    "pythonic": ("llama-3-pythonic", "[raise_alert(", ["[raise_alert(", "[get_weather("]),
}


def _transitions(tokenizer, template: str, trigger: str) -> dict[str, str]:
    """After the prompt's last token, the trigger's tokens one by one."""
    from arborlm.chat_template import load_chat_template

    prompt = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                           chat_template=load_chat_template(template))
    pieces = [token_pieces(tokenizer, prompt)[-1], *token_pieces(tokenizer, trigger)]
    assert len(set(pieces[:-1])) == len(pieces) - 1, pieces  # a bigram script cannot repeat a token
    return chain(*pieces)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_server(request, smollm_dir, tmp_path_factory):
    family = request.param
    template, trigger, markers = FAMILIES[family]
    folder = tmp_path_factory.mktemp(f"scripted_{family}")
    write_scripted_model(folder, smollm_dir, _transitions(scripted_tokenizer(smollm_dir), template, trigger))
    srv = start_server(folder, folder / "server.log", "--chat-template", template)
    yield family, srv, markers
    stop_server(srv)


@pytest.fixture
def client(family_server):
    _, srv, _ = family_server
    yield openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with srv.client() as http:
        info = wait_idle(http)
        assert info["free_req_rows"] == info["total_req_rows"]
        assert info["free_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]


def _check_calls(tool_calls) -> None:
    for call in tool_calls:
        assert call.type == "function" and call.function.name in SCHEMAS
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(client, **kwargs) -> tuple[str, dict[int, dict], str]:
    """(content, calls by index as {id, name, arguments}, finish_reason) gathered from a stream."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            if delta.id is not None:
                assert delta.index not in calls and delta.type == "function" and delta.function.arguments == ""
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                calls[delta.index]["arguments"] += delta.function.arguments
        reason = choice.finish_reason or reason
    return content, calls, reason


def _same_streamed(client, out, **kwargs) -> None:
    content, calls, reason = _streamed(client, **kwargs)
    choice = out.choices[0]
    assert reason == choice.finish_reason and content == (choice.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "raise_alert"}}],
                         ids=["auto", "required", "named"])
def test_calls_validate_and_stream_the_same(family_server, client, tool_choice):
    _, _, markers = family_server
    kwargs = dict(model="default", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                  parallel_tool_calls=False, **GREEDY)
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls)
    if isinstance(tool_choice, dict):
        assert choice.message.tool_calls[0].function.name == "raise_alert"
    _same_streamed(client, out, **kwargs)


def test_parallel_required_calls_validate(client):
    out = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         temperature=0, max_tokens=120)
    choice = out.choices[0]
    assert choice.message.tool_calls and choice.finish_reason in ("tool_calls", "length")
    _check_calls(choice.message.tool_calls)  # a call cut by max_tokens is not among them


def test_tool_choice_none_is_text_without_markup(family_server, client):
    _, _, markers = family_server
    out = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                         temperature=0, max_tokens=12)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")


def test_a_call_goes_back_into_the_history(family_server, client, smollm_dir):
    family, srv, _ = family_server
    kwargs = dict(model="default", tools=TOOLS, temperature=0, max_tokens=8)
    first = client.chat.completions.create(messages=MESSAGES, tool_choice="required", parallel_tool_calls=False,
                                           **{**kwargs, "max_tokens": 80})
    call = first.choices[0].message.tool_calls[0]
    if family == "mistral":
        assert len(call.id) == 9 and call.id.isalnum()  # the only ids its template takes back
    else:
        assert call.id.startswith("call_")
    history = [*MESSAGES, first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = client.chat.completions.create(messages=history, **kwargs)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the template rendered the call itself: the prompt is the template's own rendering
    from arborlm.chat_template import load_chat_template

    tokenizer = scripted_tokenizer(smollm_dir)
    dicts = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    prompt = tokenizer.apply_chat_template(dicts, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                           chat_template=load_chat_template(FAMILIES[family][0]))
    assert again.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
