"""Llama 3.x JSON tool calls (SGLang's ``llama3``): a JSON object per call, as the templates ask::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

Llama 3.1-3.3's templates tell the model to "respond in the format {"name":
function name, "parameters": dictionary of argument name and its value}" and
render past calls that way; `<|python_tag|>` opens tool code in those templates
(it is there for the built-in tools). Where the template has it, forced calls
open with it, as SGLang's Llama 3.2 grammar writes them; `auto` accepts a call
with or without it (the templates' own history has none). Several calls are
separated by ``;`` (SGLang's separator: the templates show one call per turn).
The parser also reads ``"arguments"`` for ``"parameters"``.
"""

from __future__ import annotations

import json
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
    standalone_calls_tag,
)

PYTHON_TAG = "<|python_tag|>"
CALL_TRIGGER = '{"name": '
CALL_END = "}"
CALL_SEPARATOR = "; "

SYNTAX = JsonCallSyntax(
    triggers=(PYTHON_TAG, CALL_TRIGGER),
    open=r"(?:<\|python_tag\|>)?",
    header=r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]+)"\s*,\s*"(?:parameters|arguments)"\s*:\s*',
    close=r"\s*\}",
    separator=r"\s*(?:;\s*)?",
    separator_markup=r"\s*;",
)


def call_begin(name: str, python_tag: bool = False) -> str:
    """The text that opens a call of `name`, up to its arguments."""
    return f'{PYTHON_TAG if python_tag else ""}{{"name": "{name}", "parameters": '


@dataclass(frozen=True)
class Llama3Format(ToolCallFormat):
    """Llama 3.x JSON calls; `python_tag`: forced calls open with `<|python_tag|>`."""

    name: ClassVar[str] = "llama3"
    instructions: ClassVar[str] = (
        'For a function call, respond in the format {"name": function name, "parameters": '
        "dictionary of argument name and its value}. Do not use variables."
    )
    python_tag: bool = False

    @classmethod
    def from_template(cls, template: str) -> Llama3Format:
        """The format a chat template asks for (`<|python_tag|>` when the template has it)."""
        return cls(python_tag=PYTHON_TAG in template)

    def structural_tag(self, functions: Sequence[FunctionSpec], choice: str, parallel: bool,
                       named: str | None = None) -> dict[str, Any]:
        """See `ToolCallFormat.structural_tag`."""
        spellings = (True, False) if self.python_tag else (False,)
        tags = {f.name: [call_tag(call_begin(f.name, tag), f.schema, CALL_END) for tag in spellings]
                for f in functions}
        triggers = [PYTHON_TAG, CALL_TRIGGER] if self.python_tag else [CALL_TRIGGER]
        return standalone_calls_tag(tags, triggers, CALL_SEPARATOR, choice, parallel, named)

    def marker_texts(self) -> tuple[str, ...]:
        """`<|python_tag|>`: a special token of every Llama 3.x tokenizer."""
        return (PYTHON_TAG,)

    def after_marker_tag(self, functions: Sequence[FunctionSpec], parallel: bool) -> dict[str, Any]:
        """The calls that follow the `<|python_tag|>` token: JSON calls separated by ``; ``."""
        tags = {f.name: [call_tag(call_begin(f.name), f.schema, CALL_END)] for f in functions}
        return standalone_calls_tag(tags, [CALL_TRIGGER], CALL_SEPARATOR, "required", parallel, None)

    def new_parser(self, names: Sequence[str]) -> ToolCallParser:
        """See `ToolCallFormat.new_parser`."""
        return JsonCallParser(SYNTAX)

    def history_text(self, calls: Sequence[tuple[str, Any]]) -> str:
        """The calls as the Llama templates render them (no `<|python_tag|>`), separated by ``; ``."""
        return CALL_SEPARATOR.join(call_begin(name) + json.dumps(arguments, ensure_ascii=False) + CALL_END
                                   for name, arguments in calls)

    def renders_natively(self, template: str) -> bool:
        """True for the Llama 3.1-3.3 templates (tools rendered, calls as `"parameters"` objects)."""
        return "tools" in template and '"parameters": ' in template and "<|start_header_id|>" in template
