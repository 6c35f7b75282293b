"""Hermes / Qwen2.5 tool calls (SGLang's ``hermes`` and ``qwen25``): one `<tool_call>` block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Qwen2.5's and Hermes 2 Pro's templates render `tools` and this block; so do
Qwen3's. It is also arborlm's format for a template without tool support
(`tool_prompt.py` describes the tools in the system message in Qwen2.5's words).
Several calls are blocks one after the other, separated by a newline.
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

CALL_TRIGGER = "<tool_call>"
CALL_END = "}\n</tool_call>"
# Between two calls of one answer (what the grammar allows when it forces calls).
CALL_SEPARATOR = "\n"

SYNTAX = JsonCallSyntax(
    triggers=(CALL_TRIGGER,),
    open=r"<tool_call>",
    # the header as the grammar writes it; whitespace tolerated for other writers
    header=r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]+)"\s*,\s*"arguments"\s*:\s*',
    close=r"\s*\}\s*</tool_call>",
)


def call_begin(name: str) -> str:
    """The text that opens a call of `name`, up to its arguments: `<tool_call>\\n{"name": "NAME", "arguments": `."""
    return f'{CALL_TRIGGER}\n{{"name": "{name}", "arguments": '


@dataclass(frozen=True)
class HermesFormat(ToolCallFormat):
    """`<tool_call>` blocks (see the module docstring)."""

    name: ClassVar[str] = "hermes"
    instructions: ClassVar[str] = (
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )

    def structural_tag(self, functions: Sequence[FunctionSpec], choice: str, parallel: bool,
                       named: str | None = None) -> dict[str, Any]:
        """See `ToolCallFormat.structural_tag`."""
        tags = {f.name: [call_tag(call_begin(f.name), f.schema, CALL_END)] for f in functions}
        return standalone_calls_tag(tags, [CALL_TRIGGER], CALL_SEPARATOR, choice, parallel, named)

    def new_parser(self, names: Sequence[str]) -> ToolCallParser:
        """See `ToolCallFormat.new_parser`."""
        return JsonCallParser(SYNTAX)

    def history_text(self, calls: Sequence[tuple[str, Any]]) -> str:
        """The calls as blocks, exactly as the model is made to write them."""
        return CALL_SEPARATOR.join(call_begin(name) + json.dumps(arguments, ensure_ascii=False) + CALL_END
                                   for name, arguments in calls)

    def renders_natively(self, template: str) -> bool:
        """True for templates that render `tools` and write `<tool_call>` (Qwen2.5, Qwen3, Hermes 2 Pro)."""
        return "tools" in template and CALL_TRIGGER in template
