"""`--reasoning-parser qwen3` on a server with Qwen3's template (`--chat-template qwen3`): the thinking
goes to `reasoning_content`, never into `content`, streamed or not, read by the official `openai`
client; `enable_thinking: false` turns it off; a `response_format` or tools constrain only what
follows the reasoning, and the answer validates.

The model is scripted (`scripted_model.py`) to write ``<think>Let me think</think>`` then
`` The answer`` and stop; under a grammar, what follows the reasoning is the grammar's.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, start_server, stop_server, wait_idle
from tests.server.scripted_model import chain, write_scripted_model

SCRIPT = chain("\n", "<think>", "Let", " me", " think", "</think>", "\n\n", " The", " answer", "<|im_end|>")
MESSAGES = [{"role": "user", "content": "Is Paris in France?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"country": {"enum": ["France", "Peru"]}}, "required": ["country"]}}}]
GREEDY = {"model": "default", "messages": MESSAGES, "temperature": 0, "max_tokens": 40}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(smollm_dir, tmp_path_factory):
    folder = write_scripted_model(tmp_path_factory.mktemp("scripted_qwen3"), smollm_dir, SCRIPT)
    srv = start_server(folder, folder / "server.log", "--chat-template", "qwen3", "--reasoning-parser", "qwen3")
    yield srv
    stop_server(srv)


@pytest.fixture
def client(server):
    yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with server.client() as http:
        info = wait_idle(http)
        assert info["free_req_rows"] == info["total_req_rows"]


def _streamed(client, **kwargs) -> tuple[str, str, list, str]:
    """(reasoning, content, tool calls as (name, arguments), finish_reason) gathered from a stream."""
    reasoning, content, calls, reason = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or ():
            calls.setdefault(call.index, [call.function.name, ""])[1] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return reasoning, content, [tuple(c) for c in calls.values()], reason


def test_thinking_goes_to_reasoning_content(client):
    message = client.chat.completions.create(**GREEDY).choices[0].message
    assert message.reasoning_content == "Let me think"  # an extra field of the client's message
    assert message.content == "The answer"
    assert _streamed(client, **GREEDY) == ("Let me think", "The answer", [], "stop")


def test_enable_thinking_false_means_no_reasoning(client):
    out = client.chat.completions.create(**GREEDY, extra_body=NO_THINKING)
    message = out.choices[0].message
    assert message.reasoning_content is None and message.content == " The answer"
    assert "<think>" not in message.content
    assert _streamed(client, **GREEDY, extra_body=NO_THINKING) == ("", " The answer", [], "stop")


@pytest.mark.parametrize("extra", [{}, NO_THINKING], ids=["thinking", "no thinking"])
def test_schema_constrains_what_follows_the_reasoning(client, extra):
    kwargs = {**GREEDY, "response_format": FORMAT, "extra_body": extra}
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert choice.message.reasoning_content == (None if extra else "Let me think")
    assert _streamed(client, **kwargs) == (choice.message.reasoning_content or "", choice.message.content, [], "stop")


def test_forced_tool_call_after_the_reasoning(client):
    kwargs = {**GREEDY, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "Let me think"
    call = choice.message.tool_calls[0]
    assert call.function.name == "lookup" and json.loads(call.function.arguments)["country"] in ("France", "Peru")
    assert _streamed(client, **kwargs) == ("Let me think", "", [("lookup", call.function.arguments)], "tool_calls")


def test_separate_reasoning_false_keeps_the_thinking_in_content(client):
    message = client.chat.completions.create(**GREEDY, extra_body={"separate_reasoning": False}).choices[0].message
    assert message.content == "<think>Let me think</think>\n\n The answer"
    assert getattr(message, "reasoning_content", None) is None


def test_reasoning_cut_by_max_tokens(client):
    out = client.chat.completions.create(**{**GREEDY, "max_tokens": 3})
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "length"
    assert message.reasoning_content == "Let me" and message.content == ""


R1_SCRIPT = chain("\n", "Let", " me", " think", "</think>", "\n\n", " The", " answer", "<|im_end|>")


@pytest.fixture(scope="module")
def r1_client(smollm_dir, tmp_path_factory):
    """DeepSeek-R1's template ends the prompt with `<think>`: the output starts inside the reasoning."""
    folder = write_scripted_model(tmp_path_factory.mktemp("scripted_r1"), smollm_dir, R1_SCRIPT)
    srv = start_server(folder, folder / "server.log", "--chat-template", "deepseek-r1",
                       "--reasoning-parser", "deepseek-r1")
    yield openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    stop_server(srv)


@pytest.mark.parametrize("response_format", [None, FORMAT], ids=["text", "json_schema"])
def test_deepseek_r1_starts_inside_the_reasoning(r1_client, response_format):
    kwargs = {**GREEDY, **({"response_format": response_format} if response_format else {})}
    choice = r1_client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "stop" and choice.message.reasoning_content == "Let me think"
    if response_format:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    else:
        assert choice.message.content == "The answer"
    assert _streamed(r1_client, **kwargs) == ("Let me think", choice.message.content, [], "stop")


def test_logit_bias_over_the_cap_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**GREEDY, logit_bias={str(i): 1 for i in range(1025)})
    assert e.value.body["param"] == "logit_bias"
