"""`--chat-template`, `--tool-call-parser`, `--reasoning-parser`: config checks, the CLI, the template
override on the tokenizer, and a call format named on a template that does not render it; no server."""

from __future__ import annotations

import pytest

from arborlm.chat_template import (
    BUILTIN_CHAT_TEMPLATES,
    apply_chat_template_override,
    load_chat_template,
)
from arborlm.cli import build_parser, server_args_from
from arborlm.entrypoints.openai.chat_render import render_chat
from arborlm.entrypoints.openai.protocol import ChatMessage
from arborlm.entrypoints.openai.tool_parsers.pythonic import PythonicFormat
from arborlm.entrypoints.openai.tool_parsers.registry import tool_call_format
from arborlm.runtime.config import ServerArgs

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("field, value", [("chat_template", "no-such-template"), ("chat_template", "/no/such.jinja"),
                                          ("tool_call_parser", "qwen3_coder"), ("reasoning_parser", "o1")])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ServerArgs.from_kwargs(**{field: value})


def test_a_template_file_or_a_builtin_name(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert ServerArgs.from_kwargs(chat_template=str(path)).chat.chat_template == str(path)
    assert load_chat_template(str(path)) == path.read_text()
    assert {"chatml", "qwen3", "deepseek-r1", "llama-3-instruct", "llama-3-pythonic", "mistral"} <= set(
        BUILTIN_CHAT_TEMPLATES)
    with pytest.raises(ValueError, match="chat_template"):
        load_chat_template("nope")


def test_cli_options():
    args = build_parser().parse_args(["serve", "--chat-template", "qwen3", "--tool-call-parser", "llama3",
                                      "--reasoning-parser", "deepseek-r1"])
    chat = server_args_from(args).chat
    assert (chat.chat_template, chat.tool_call_parser, chat.reasoning_parser) == ("qwen3", "llama3", "deepseek-r1")
    defaults = server_args_from(build_parser().parse_args(["serve"])).chat
    assert (defaults.chat_template, defaults.tool_call_parser, defaults.reasoning_parser) == (None, None, None)


def test_the_override_replaces_the_tokenizer_template(tiny_tokenizer):
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)
    before = tokenizer.chat_template
    assert apply_chat_template_override(tokenizer, None).chat_template == before
    assert apply_chat_template_override(tokenizer, "llama-3-instruct").chat_template == load_chat_template(
        "llama-3-instruct")
    messages = [ChatMessage(role="user", content="Weather in Paris?")]
    prompt = render_chat(tokenizer, messages, tools=TOOLS, fmt=tool_call_format(None, tokenizer.chat_template))
    assert '"parameters": dictionary of argument name' in prompt.text and "<|start_header_id|>user" in prompt.text
    assert prompt.input_ids == tokenizer.encode(prompt.text, add_special_tokens=False)


def test_a_named_format_on_a_template_without_tools_is_described_in_the_system_prompt(tiny_tokenizer):
    fmt = PythonicFormat()
    assert not fmt.renders_natively(tiny_tokenizer.chat_template)  # SmolLM2's template has no tools
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]]
    prompt = render_chat(tiny_tokenizer, messages, tools=TOOLS, fmt=fmt).text
    assert fmt.instructions in prompt and "<tools>" in prompt
    assert '[get_weather(city="Paris")]' in prompt  # the history in the format's own text
    assert "<tool_call>" not in prompt.split("</tools>")[1]


def test_no_template_is_a_400_that_names_the_option(tiny_tokenizer):
    import copy

    from arborlm.entrypoints.http_errors import APIError

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(APIError, match="--chat-template"):
        render_chat(tokenizer, [ChatMessage(role="user", content="hi")])
