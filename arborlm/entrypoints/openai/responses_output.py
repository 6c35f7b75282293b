"""One response's output text → Responses API output items and their stream events.

`OutputBuilder` reads the generated text as it arrives (or whole, at once) and
keeps the output items in order: a ``reasoning`` item for the thinking
(`--reasoning-parser`), ``message`` items for the text, a ``function_call``
item per tool call (the server's call format parses them, as on the chat
route). Each piece of text yields the semantic events OpenAI streams:
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` / ``response.reasoning_text.delta`` /
``response.function_call_arguments.delta``, their ``.done`` events and
``response.output_item.done``. A streamed and a non-streamed response are
built by the same code, so their `output` is the same.

Text that is only whitespace does not open a message item (the newlines a
model writes between tool calls); a response with no item at all gets one
empty message. When the output ends, each call is checked as the chat route
checks it (`tool_calls.checked_calls`): a call cut off before its arguments
were whole is left out of the final output (its streamed item is done with
status ``incomplete``), and a call whose arguments fail the schema fails the
response.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from arborlm.entrypoints.openai.reasoning_parser import ReasoningParser
from arborlm.entrypoints.openai.tool_calls import ToolPlan
from arborlm.entrypoints.openai.tool_parsers.base import ArgumentsDelta, CallStart, ToolCallParser


def item_id(prefix: str) -> str:
    """An output item id in OpenAI's style (``msg_``, ``rs_``, ``fc_`` and hex digits)."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Item:
    """One output item being built; `body` is its JSON object, `text` its text or arguments so far."""

    body: dict[str, Any]
    text: str = ""
    open: bool = True
    call_index: int | None = None  # the parser's index of a function_call item


@dataclass
class Finished:
    """The output once the text has ended: its items, and why a call was dropped (None when none was)."""

    output: list[dict[str, Any]]
    dropped: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)  # chat `tool_calls` entries, for the store
    text: str = ""
    reasoning: str = ""


class OutputBuilder:
    """Builds one response's output items from its text (see the module docstring).

    Parameters
    ----------
    reasoning: splits off the thinking (None without a reasoning parser).
    plan: the offered tools (None without tools).
    """

    def __init__(self, reasoning: ReasoningParser | None, plan: ToolPlan | None):
        self.reasoning = reasoning
        self.plan = plan
        self.tools: ToolCallParser | None = plan.new_parser() if plan is not None else None
        self.items: list[_Item] = []
        self._pending_space = ""

    # ---- feeding --------------------------------------------------------------

    def feed(self, text: str, last: bool) -> list[dict[str, Any]]:
        """The events (without `sequence_number`) of one more piece of output; `last`: the output ended."""
        events: list[dict[str, Any]] = []
        thinking, content = "", text
        if self.reasoning is not None:
            parts = [self.reasoning.feed(text), *([self.reasoning.finish()] if last else [])]
            thinking, content = "".join(p.reasoning for p in parts), "".join(p.content for p in parts)
        if thinking:
            self._reasoning_delta(events, thinking)
        if self.tools is None:
            self._text_delta(events, content)
        else:
            for event in self.tools.feed(content) + (self.tools.finish() if last else []):
                self._tool_event(events, event)
        if last:
            if not self.items:
                self._open_message(events)
            self._close_open(events)
        return events

    def _tool_event(self, events: list[dict[str, Any]], event) -> None:
        if isinstance(event, CallStart):
            self._close_open(events)
            body = {"id": item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": event.id,
                    "name": event.name, "arguments": ""}
            self._add(events, _Item(body, call_index=event.index))
        elif isinstance(event, ArgumentsDelta):
            item = self.items[-1]
            item.text += event.text
            events.append({"type": "response.function_call_arguments.delta", "item_id": item.body["id"],
                           "output_index": len(self.items) - 1, "delta": event.text})
        else:
            self._text_delta(events, event.text)

    def _reasoning_delta(self, events: list[dict[str, Any]], text: str) -> None:
        item = self._current("reasoning")
        if item is None:
            self._close_open(events)
            body = {"id": item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            item = self._add(events, _Item(body))
            events.append(self._part_event("added", item, {"type": "reasoning_text", "text": ""}))
        item.text += text
        events.append({"type": "response.reasoning_text.delta", "item_id": item.body["id"],
                       "output_index": self.items.index(item), "content_index": 0, "delta": text})

    def _text_delta(self, events: list[dict[str, Any]], text: str) -> None:
        if not text:
            return
        item = self._current("message")
        if item is None:
            if not text.strip():
                self._pending_space += text
                return
            text, self._pending_space = self._pending_space + text, ""
            item = self._open_message(events)
        item.text += text
        events.append({"type": "response.output_text.delta", "item_id": item.body["id"],
                       "output_index": self.items.index(item), "content_index": 0, "delta": text,
                       "logprobs": []})

    def _open_message(self, events: list[dict[str, Any]]) -> _Item:
        self._close_open(events)
        body = {"id": item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                "content": []}
        item = self._add(events, _Item(body))
        events.append(self._part_event("added", item, _text_part("")))
        return item

    def _current(self, kind: str) -> _Item | None:
        """The open item when it is of type `kind`."""
        if self.items and self.items[-1].open and self.items[-1].body["type"] == kind:
            return self.items[-1]
        return None

    def _add(self, events: list[dict[str, Any]], item: _Item) -> _Item:
        self.items.append(item)
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": dict(item.body)})
        return item

    def _part_event(self, what: str, item: _Item, part: dict[str, Any]) -> dict[str, Any]:
        return {"type": f"response.content_part.{what}", "item_id": item.body["id"],
                "output_index": self.items.index(item), "content_index": 0, "part": part}

    # ---- closing --------------------------------------------------------------

    def _close_open(self, events: list[dict[str, Any]]) -> None:
        if not self.items or not self.items[-1].open:
            return
        item, index = self.items[-1], len(self.items) - 1
        item.open = False
        kind, ref = item.body["type"], {"item_id": item.body["id"], "output_index": index}
        if kind == "message":
            part = _text_part(item.text)
            item.body.update(status="completed", content=[part])
            events.append({"type": "response.output_text.done", **ref, "content_index": 0, "text": item.text,
                           "logprobs": []})
            events.append(self._part_event("done", item, part))
        elif kind == "reasoning":
            part = {"type": "reasoning_text", "text": item.text}
            item.body.update(status="completed", content=[part])
            events.append({"type": "response.reasoning_text.done", **ref, "content_index": 0, "text": item.text})
            events.append(self._part_event("done", item, part))
        else:
            complete = self.tools.calls[item.call_index].complete
            item.body.update(status="completed" if complete else "incomplete", arguments=item.text)
            events.append({"type": "response.function_call_arguments.done", **ref, "name": item.body["name"],
                           "arguments": item.text})
        events.append({"type": "response.output_item.done", "output_index": index, "item": dict(item.body)})

    def finish(self) -> Finished:
        """The final output (call after `feed(..., last=True)`): cut-off calls left out, every
        complete call checked against its schema."""
        output, problems, calls, texts, thinking = [], [], [], [], []
        for item in self.items:
            kind = item.body["type"]
            if kind == "function_call":
                call = self.tools.calls[item.call_index]
                if not call.complete:
                    continue
                problem = self.plan.check_call(call)
                if problem is not None:
                    problems.append(f"the call of {call.name} was dropped: {problem}")
                    continue
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
            elif kind == "message":
                texts.append(item.text)
            else:
                thinking.append(item.text)
            output.append(item.body)
        return Finished(output, "; ".join(problems) or None, calls, "".join(texts), "".join(thinking))


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
