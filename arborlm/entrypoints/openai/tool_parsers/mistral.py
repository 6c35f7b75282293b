"""Mistral tool calls (SGLang's ``mistral``): one `[TOOL_CALLS]` list of JSON calls::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

The format of Mistral 7B Instruct v0.3 and Mixtral 8x22B Instruct: their
templates render `tools` in `[AVAILABLE_TOOLS]` and past calls as this list,
each item with an `"id"` after its arguments (the parser skips it). One list
per answer: `auto` is free text until `[TOOL_CALLS]`, then the list, then the
end; several calls are items of the list. Call ids are 9 letters and digits,
since these templates refuse any other length in the history they are sent back in.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from arborlm.entrypoints.openai.tool_parsers.base import (
    FunctionSpec,
    ToolCallFormat,
    ToolCallParser,
)
from arborlm.entrypoints.openai.tool_parsers.json_calls import (
    JsonCallParser,
    JsonCallSyntax,
    call_tag,
)

CALL_TRIGGER = "[TOOL_CALLS]"
LIST_BEGIN = "[TOOL_CALLS] ["
LIST_END = "]"
CALL_END = "}"
CALL_SEPARATOR = ", "

SYNTAX = JsonCallSyntax(
    triggers=(CALL_TRIGGER,),
    open=r"\[TOOL_CALLS\]\s*\[",
    header=r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]+)"\s*,\s*"arguments"\s*:\s*',
    # the end of one call; an "id" key the templates write after the arguments is skipped
    close=r'\s*(?:,\s*"id"\s*:\s*"[^"\\]*"\s*)?\}',
    next_call=r"\s*,",
    close_group=r"\s*\]",
)


def mistral_call_id() -> str:
    """A call id the Mistral templates accept: 9 letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def call_begin(name: str) -> str:
    """The text of one list item up to its arguments."""
    return f'{{"name": "{name}", "arguments": '


@dataclass(frozen=True)
class MistralFormat(ToolCallFormat):
    """`[TOOL_CALLS]` lists (see the module docstring)."""

    name: ClassVar[str] = "mistral"
    instructions: ClassVar[str] = (
        'To call functions, answer with [TOOL_CALLS] and a JSON list of calls: '
        '[TOOL_CALLS] [{"name": <function-name>, "arguments": <args-json-object>}]'
    )

    def structural_tag(self, functions: Sequence[FunctionSpec], choice: str, parallel: bool,
                       named: str | None = None) -> dict[str, Any]:
        """See `ToolCallFormat.structural_tag`."""
        if choice == "named":
            schema = next(f.schema for f in functions if f.name == named)
            return call_tag(LIST_BEGIN + call_begin(named), schema, CALL_END + LIST_END)
        calls = {"type": "tag", "begin": LIST_BEGIN, "content": _items(functions, parallel), "end": LIST_END}
        if choice == "required":
            return calls
        return {"type": "triggered_tags", "triggers": [CALL_TRIGGER], "tags": [calls], "stop_after_first": True}

    def marker_texts(self) -> tuple[str, ...]:
        """`[TOOL_CALLS]`: a control token of Mistral v0.3's and Mixtral 8x22B's tokenizers."""
        return (CALL_TRIGGER,)

    def after_marker_tag(self, functions: Sequence[FunctionSpec], parallel: bool) -> dict[str, Any]:
        """The list that follows the `[TOOL_CALLS]` token: ` [` calls `]`."""
        return {"type": "tag", "begin": LIST_BEGIN.removeprefix(CALL_TRIGGER), "content": _items(functions, parallel),
                "end": LIST_END}

    def new_parser(self, names: Sequence[str]) -> ToolCallParser:
        """See `ToolCallFormat.new_parser`."""
        return JsonCallParser(SYNTAX, call_id=mistral_call_id)

    def history_text(self, calls: Sequence[tuple[str, Any]]) -> str:
        """The calls as one `[TOOL_CALLS]` list."""
        items = [call_begin(name) + json.dumps(arguments, ensure_ascii=False) + CALL_END for name, arguments in calls]
        return LIST_BEGIN + CALL_SEPARATOR.join(items) + LIST_END

    def renders_natively(self, template: str) -> bool:
        """True for templates that write `[TOOL_CALLS]` (Mistral v0.3, Mixtral 8x22B)."""
        return CALL_TRIGGER in template


def _items(functions: Sequence[FunctionSpec], parallel: bool) -> dict[str, Any]:
    """The list's items: calls of the offered functions, at least one (one only unless `parallel`)."""
    return {"type": "tags_with_separator", "tags": [call_tag(call_begin(f.name), f.schema, CALL_END) for f in functions],
            "separator": CALL_SEPARATOR, "at_least_one": True, "stop_after_first": not parallel}
