"""Responses API input → chat messages, the form the chat route renders.

A Responses `input` is a string or a list of items; a tool turn is a
``function_call`` item (what the model called) and a ``function_call_output``
item (what the tool answered, by `call_id`). Each item becomes a chat message
dict (`protocol.ChatMessage`'s fields): consecutive ``function_call`` items
join the assistant message before them as its `tool_calls`, a tool output
becomes a ``tool`` message. `Conversation.sources` says which request field
each message came from, so an error the chat rendering raises about
``messages[4]`` is answered about ``input[2]``.

Errors (400, naming the field): an item of an unknown type, a content part
that is not text, a ``function_call_output`` whose `call_id` no earlier
``function_call`` (in this input or the previous response) made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from arborlm.entrypoints.http_errors import bad_request, validation_error

# Content part types whose text is read; the others (images, files, audio) are refused.
TEXT_PART_TYPES = ("input_text", "output_text", "text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class _Item(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]


@dataclass
class Conversation:
    """Chat message dicts, the request field each came from, and the calls made so far (id → name)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    calls: dict[str, str] = field(default_factory=dict)

    def add(self, message: dict[str, Any], source: str) -> None:
        self.messages.append(message)
        self.sources.append(source)

    def extended(self, source: str) -> Conversation:
        """A copy whose messages so far are all named `source` (a previous response's conversation)."""
        return Conversation([dict(m) for m in self.messages], [source] * len(self.messages), dict(self.calls))


def build_conversation(input_: str | list[dict[str, Any]], instructions: str | None,
                       previous: Conversation | None) -> Conversation:
    """The chat messages of a request: `instructions` as a system message first, the
    `previous` response's conversation, then `input`.

    Raises
    ------
    APIError: 400 naming the item or part (see the module docstring), or `input`
        when there is nothing to answer.
    """
    conv = Conversation()
    if instructions:
        conv.add({"role": "system", "content": instructions}, "instructions")
    if previous is not None:
        before = previous.extended("previous_response_id")
        conv.messages += before.messages
        conv.sources += before.sources
        conv.calls.update(before.calls)
    if isinstance(input_, str):
        conv.add({"role": "user", "content": input_}, "input")
    else:
        for index, item in enumerate(input_):
            _add_item(conv, item, index)
    if not any(m["role"] != "system" for m in conv.messages):
        raise bad_request("input has no message to answer", param="input")
    return conv


def _add_item(conv: Conversation, item: dict[str, Any], index: int) -> None:
    where = f"input[{index}]"
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        message = _parse(MessageItem, item, index)
        role = "system" if message.role == "developer" else message.role
        conv.add({"role": role, "content": _text(message.content, f"{where}.content")}, where)
    elif kind == "function_call":
        call = _parse(FunctionCallItem, item, index)
        _add_call(conv, call, where)
    elif kind == "function_call_output":
        out = _parse(FunctionCallOutputItem, item, index)
        if out.call_id not in conv.calls:
            raise bad_request(f"no function_call with call_id {out.call_id!r} comes before this output "
                              "(in input or in the previous response)", param=f"{where}.call_id")
        content = _text(out.output, f"{where}.output")
        conv.add({"role": "tool", "tool_call_id": out.call_id, "name": conv.calls[out.call_id],
                  "content": content}, where)
    elif kind == "reasoning":
        return  # past reasoning is not rendered (chat templates drop it too)
    else:
        raise bad_request(f"input items of type {kind!r} are not supported; this server reads "
                          f"{', '.join(ITEM_TYPES)} items", param=f"{where}.type")


def _add_call(conv: Conversation, call: FunctionCallItem, where: str) -> None:
    """A `function_call` joins the assistant message right before it, or opens one."""
    try:
        json.loads(call.arguments)
    except ValueError:
        raise bad_request("arguments must be JSON text", param=f"{where}.arguments") from None
    entry = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    conv.calls[call.call_id] = call.name
    last = conv.messages[-1] if conv.messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(entry)
        return
    conv.add({"role": "assistant", "content": None, "tool_calls": [entry]}, where)


def _parse(model: type[_Item], item: dict[str, Any], index: int) -> Any:
    """`item` validated as `model`; a 400 naming ``input[index].<field>``."""
    try:
        return model.model_validate(item)
    except ValidationError as e:
        raise validation_error([{**err, "loc": ("input", index, *err["loc"])} for err in e.errors()]) from None


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """A message's (or a tool output's) text: the string, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind not in TEXT_PART_TYPES:
            raise bad_request(f"content parts of type {kind!r} are not supported; this model reads text parts "
                              f"({', '.join(TEXT_PART_TYPES)})", param=f"{where}[{j}].type")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request("a text part needs text", param=f"{where}[{j}].text")
        texts.append(text)
    return "\n".join(texts)


def assistant_message(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat message of one response's output (its text and the calls it made), for the store."""
    return {"role": "assistant", "content": text if text or not calls else None, "tool_calls": calls or None}
