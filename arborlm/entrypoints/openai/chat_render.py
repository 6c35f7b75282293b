"""OpenAI chat messages → the prompt's token ids, through the model's chat template.

Messages become the dicts Hugging Face chat templates read (`role`, `content`
as one string, `tool_calls`, `tool_call_id`, `name`); `developer` is rendered as
`system`. Only text content parts are served. `continue_final_message` renders
the final assistant message open (no end-of-turn) so the model continues it.
Offered tools and the tool-call history are written as `tool_prompt.py` says:
through the template when it renders the server's call format, else into the
messages. The template is the tokenizer's, or `--chat-template`'s, which the
server puts on the tokenizer when it loads it (`chat_template.py`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from arborlm.entrypoints.http_errors import bad_request
from arborlm.entrypoints.openai.protocol import ChatMessage
from arborlm.entrypoints.openai.tool_parsers.base import ToolCallFormat
from arborlm.entrypoints.openai.tool_parsers.hermes import HermesFormat
from arborlm.entrypoints.openai.tool_prompt import (
    content_with_calls,
    history_tool_calls,
    renders_tools,
    tool_response,
    with_tools_described,
)

TEXT_PART_SEPARATOR = "\n"


def message_dict(message: ChatMessage, index: int, native_tools: bool = False,
                 fmt: ToolCallFormat | None = None) -> dict[str, Any]:
    """One message as a chat-template dict.

    `native_tools`: the template renders tool calls itself; otherwise calls and
    tool results are written into the content (`tool_prompt.py`), in the call
    format `fmt` (Hermes when None).

    Raises
    ------
    APIError: 400 for a non-text content part, missing content where it is
        required, or tool calls that are not the assistant's or not JSON.
    """
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": _content_text(message, index)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        if role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", param=f"messages[{index}].tool_calls")
        calls = history_tool_calls(message, index)
        if native_tools:
            out["tool_calls"] = calls
        else:
            out["content"] = content_with_calls(out["content"], calls, fmt or HermesFormat())
    if role == "tool" and not native_tools:
        out["content"] = tool_response(out["content"])
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _content_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        if message.role == "assistant" and message.tool_calls:
            return ""
        raise bad_request(f"a {message.role} message needs content", param=f"messages[{index}].content")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise bad_request(
                f"content parts of type {part.type!r} are not supported; this model reads text parts only",
                param=f"messages[{index}].content[{j}].type",
            )
        if part.text is None:
            raise bad_request("a text part needs text", param=f"messages[{index}].content[{j}].text")
        texts.append(part.text)
    return TEXT_PART_SEPARATOR.join(texts)


# Arguments of `apply_chat_template` the server sets; template variables may not override them.
RENDER_ARGUMENTS = frozenset({
    "conversation", "tokenize", "add_generation_prompt", "continue_final_message", "tools", "documents",
    "chat_template", "return_tensors", "return_dict", "return_assistant_tokens_mask", "padding",
    "truncation", "max_length", "tokenizer_kwargs",
})


class RenderedChat(NamedTuple):
    """A rendered prompt: its text (the reasoning parser reads how it ends) and its token ids."""

    text: str
    input_ids: list[int]


def render_chat(tokenizer, messages: list[ChatMessage], continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None, fmt: ToolCallFormat | None = None) -> RenderedChat:
    """The prompt for `messages` under the tokenizer's chat template.

    `tools`: OpenAI `tools` entries offered to the model (None: none offered);
    `fmt`: the server's tool-call format (Hermes when None).

    Raises
    ------
    APIError: 400 when the model has no chat template, when `continue_final_message`
        is set but the last message is not the assistant's, when `template_kwargs`
        sets an argument the server sets itself (`RENDER_ARGUMENTS`), or when the
        template refuses the messages (e.g. roles that must alternate).
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise bad_request("this model has no chat template; use /v1/completions or start the server with "
                          "--chat-template", param="messages")
    fmt = fmt or HermesFormat()
    native_tools = renders_tools(template, fmt)
    dicts = [message_dict(m, i, native_tools, fmt) for i, m in enumerate(messages)]
    if continue_final_message and dicts[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs a final assistant message to continue",
                          param="continue_final_message")
    reserved = sorted(set(template_kwargs or {}) & RENDER_ARGUMENTS)
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets "
            f"{', '.join(sorted(RENDER_ARGUMENTS))} itself (use the request's own fields)",
            param="chat_template_kwargs",
        )
    kwargs = dict(template_kwargs or {})
    if tools and native_tools:
        kwargs["tools"] = tools
    elif tools:
        dicts = with_tools_described(dicts, tools, fmt)
    try:
        text = tokenizer.apply_chat_template(
            dicts, tokenize=False, add_generation_prompt=not continue_final_message,
            continue_final_message=continue_final_message, **kwargs,
        )
    except Exception as e:  # noqa: BLE001 - jinja raises TemplateError, ValueError, TypeError ...
        raise bad_request(f"the chat template cannot render these messages: {e}", param="messages") from None
    return RenderedChat(text, tokenizer.encode(text, add_special_tokens=False))
