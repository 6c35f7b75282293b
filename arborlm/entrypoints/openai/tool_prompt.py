"""How offered tools and the tool-call history reach the prompt.

A chat template that already speaks the server's call format (`tool_parsers/`:
it renders `tools` and writes that format's calls, as Qwen2.5's, Llama 3.1's
and Mistral v0.3's do) gets the tools as `tools=` and the history as the
template expects it (each call's arguments as an object, which the template
serialises itself).

Any other template (SmolLM2's has no tool support) gets the tools and the
history written into the messages, in Qwen2.5's words and the call format's
text (Hermes blocks unless `--tool-call-parser` names another):

- the tools are described at the end of the system message (a system message
  is added first when there is none), in the words of Qwen2.5's template::

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
      </tools>

      For each function call, return a json object with function name and arguments
      within <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

  (the last paragraph is the format's `instructions`);
- an assistant message's `tool_calls` are written after its content in the
  format's text (`history_text`), exactly as the model is made to write them;
- a `tool` message's content is wrapped in `<tool_response>` ... `</tool_response>`
  (its role stays `tool`).
"""

from __future__ import annotations

import json
from typing import Any

from arborlm.entrypoints.http_errors import bad_request
from arborlm.entrypoints.openai.protocol import ChatMessage
from arborlm.entrypoints.openai.tool_parsers.base import ToolCallFormat

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = "</tools>\n\n"


def renders_tools(template: str | None, fmt: ToolCallFormat) -> bool:
    """True when the chat template renders `tools` and calls in the format `fmt` itself."""
    return isinstance(template, str) and fmt.renders_natively(template)


def tools_system_prompt(definitions: list[dict[str, Any]], fmt: ToolCallFormat) -> str:
    """The description of the tools for a template without tool support (see the module docstring)."""
    lines = [json.dumps(d, ensure_ascii=False) for d in definitions]
    return "\n".join([TOOLS_HEADER, *lines, TOOLS_FOOTER + fmt.instructions])


def with_tools_described(dicts: list[dict[str, Any]], definitions: list[dict[str, Any]],
                         fmt: ToolCallFormat) -> list[dict[str, Any]]:
    """The messages with the tools described at the end of the (first) system message."""
    prompt = tools_system_prompt(definitions, fmt)
    if dicts and dicts[0]["role"] == "system":
        first = dicts[0]
        content = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [{**first, "content": content}, *dicts[1:]]
    return [{"role": "system", "content": prompt}, *dicts]


def history_tool_calls(message: ChatMessage, index: int) -> list[dict[str, Any]]:
    """An assistant message's tool calls as chat-template dicts, arguments parsed to objects.

    Raises
    ------
    APIError: 400 naming `messages[index].tool_calls[j].function.arguments` when
        the arguments are not JSON.
    """
    calls = []
    for j, call in enumerate(message.tool_calls or ()):
        arguments = call.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as e:
                raise bad_request(f"the arguments of a tool call are not JSON: {e}",
                                  param=f"messages[{index}].tool_calls[{j}].function.arguments") from None
        out: dict[str, Any] = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
        if call.id is not None:
            out["id"] = call.id
        calls.append(out)
    return calls


def content_with_calls(content: str, calls: list[dict[str, Any]], fmt: ToolCallFormat) -> str:
    """An assistant message's content followed by its calls in the format's text."""
    text = fmt.history_text([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    return f"{content}\n{text}" if content else text


def tool_response(content: str) -> str:
    """A tool message's content as Hermes templates write it."""
    return f"<tool_response>\n{content}\n</tool_response>"
