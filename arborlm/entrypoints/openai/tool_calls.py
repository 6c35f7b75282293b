"""Tool calls on `/v1/chat/completions`: `tools` and `tool_choice` → the grammar, and the
model's output → OpenAI's `tool_calls`.

`plan_tools` checks the request's tools (each `parameters` must be the schema
of an object, `{"type": "object", ...}`, and is prepared as a `json_schema`
would be, so a broken one is a 400 naming `tools[i].function.parameters`) and
resolves `tool_choice`:

- ``none`` (or no tools): no tools are offered, the output is plain text;
- ``auto`` (the default with tools): free text, and wherever the model starts a
  call (the format's trigger, such as `<tool_call>`) the rest of the call is
  forced to a valid call (xgrammar's ``triggered_tags`` structural tag);
- ``required``: only calls, at least one;
- a named function: exactly one call of it.

`parallel_tool_calls: false` ends the grammar after the first call. The call
text is the server's `ToolCallFormat` (`tool_parsers/`: Hermes, Llama 3,
Mistral, pythonic), which builds the grammar and parses the output; how tools
reach the prompt is in `tool_prompt.py`. Every complete call's arguments are
validated against the function's schema.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from arborlm.constrained.json_schema import (
    PreparedSchema,
    prepare_json_schema,
    validate_json_output,
)
from arborlm.constrained.keys import GrammarError, GrammarKey
from arborlm.constrained.registry import backend_class
from arborlm.entrypoints.http_errors import bad_request
from arborlm.entrypoints.openai.common import openai_error
from arborlm.entrypoints.openai.protocol import ChatCompletionRequest, ToolDefinition
from arborlm.entrypoints.openai.tool_parsers.base import (
    ArgumentsDelta,
    CallStart,
    Event,
    FunctionSpec,
    ParsedCall,
    ToolCallFormat,
    ToolCallParser,
    parse_whole,
)
from arborlm.entrypoints.openai.tool_parsers.hermes import HermesFormat

logger = logging.getLogger(__name__)

# OpenAI's rule for function names; it also keeps names free of JSON escapes. Matched with
# fullmatch: `$` would also match before a trailing newline.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The arguments of a function declared without `parameters` (OpenAI: no parameters).
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    """One offered function: its definition as sent and its prepared argument schema."""

    name: str
    definition: dict[str, Any]
    schema: PreparedSchema

    @property
    def spec(self) -> FunctionSpec:
        """What the format's grammar needs: the name and the schema in the backend's form."""
        return FunctionSpec(self.name, json.loads(self.schema.text))


@dataclass(frozen=True)
class ToolPlan:
    """How one request may call tools.

    tools: every tool, in request order (all are described to the model).
    choice: ``auto``, ``required`` or ``named``.
    named: the forced function's name when ``choice`` is ``named``.
    parallel: several calls allowed in one answer.
    format: the server's tool-call format (grammar and parser).
    """

    tools: tuple[Tool, ...]
    choice: str
    named: str | None
    parallel: bool
    format: ToolCallFormat

    @property
    def definitions(self) -> list[dict[str, Any]]:
        """The tools as OpenAI `tools` entries (for the chat template or the system prompt)."""
        return [t.definition for t in self.tools]

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tools]

    def structural_tag(self) -> dict[str, Any]:
        """The grammar of the answer, as an xgrammar structural tag (see the module docstring).

        Raises
        ------
        GrammarError: a schema the format cannot express (pythonic: a property
            name that is not a Python identifier).
        """
        fmt = self.format.structural_tag([t.spec for t in self.tools], self.choice, self.parallel, self.named)
        return {"type": "structural_tag", "format": fmt}

    def new_parser(self) -> ToolCallParser:
        """A parser for one choice's output."""
        return self.format.new_parser(self.names)

    def parse(self, text: str) -> ToolCallParser:
        """A whole output parsed at once."""
        return parse_whole(self.format, text, self.names)

    def check_call(self, call: ParsedCall) -> str | None:
        """None when a complete call names an offered function and its arguments satisfy its schema."""
        tool = next((t for t in self.tools if t.name == call.name), None)
        if tool is None:
            return f"the model called an unknown function {call.name!r}"
        return validate_json_output(tool.schema, call.arguments)


# ---- the request ---------------------------------------------------------------------


def plan_tools(req: ChatCompletionRequest, grammar_backend: str,
               fmt: ToolCallFormat | None = None) -> ToolPlan | None:
    """The request's `ToolPlan` in the call format `fmt` (Hermes when None), or None when no
    tools are offered (none given, or `tool_choice="none"`).

    Raises
    ------
    APIError: 400 for `tool_choice` without tools, a named function that is not
        among the tools, a bad or duplicate function name, a broken `parameters`
        schema (or one `fmt` cannot express), or a grammar backend without
        structural tags.
    """
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    _check_backend(grammar_backend)
    tools = tuple(_tool(definition, i, grammar_backend) for i, definition in enumerate(req.tools))
    _check_unique([t.name for t in tools])
    named = None
    if choice is not None and not isinstance(choice, str):
        named = choice.function.name
        if named not in {t.name for t in tools}:
            raise bad_request(f"tool_choice names {named!r}, which is not among the tools",
                              param="tool_choice.function.name")
    mode = "named" if named else (choice or "auto")
    plan = ToolPlan(tools, mode, named, req.parallel_tool_calls is not False, fmt or HermesFormat())
    _check_expressible(plan)
    return plan


def _check_expressible(plan: ToolPlan) -> None:
    """Build the grammar once, so that a schema the format cannot write is a 400 naming its tool.

    Raises
    ------
    APIError: 400 naming `tools[i].function.parameters`.
    """
    for i, tool in enumerate(plan.tools):
        try:
            plan.format.structural_tag([tool.spec], "auto", True)
        except GrammarError as e:
            raise bad_request(str(e), param=f"tools[{i}].function.parameters") from None


def _check_backend(grammar_backend: str) -> None:
    if "structural_tag" not in backend_class(grammar_backend).kinds:
        raise bad_request(f"tool calls need structural tags, which the {grammar_backend} grammar backend "
                          "lacks; start the server with --grammar-backend xgrammar", param="tools")


def _tool(definition: ToolDefinition, index: int, grammar_backend: str) -> Tool:
    """One tool, its name and argument schema checked.

    Raises
    ------
    APIError: 400 naming `tools[index].function.name` or `.parameters`.
    """
    function = definition.function
    if not FUNCTION_NAME.fullmatch(function.name):
        raise bad_request("a function name must be 1 to 64 letters, digits, underscores or dashes, "
                          f"got {function.name!r}", param=f"tools[{index}].function.name")
    param = f"tools[{index}].function.parameters"
    parameters = NO_PARAMETERS if not function.parameters else function.parameters
    if parameters.get("type") != "object":
        raise bad_request(f'{param} must be the JSON Schema of an object ({{"type": "object", "properties": ...}}): '
                          f"the arguments are a JSON object; got type {parameters.get('type')!r}", param=param)
    try:
        schema = prepare_json_schema(parameters, lenient=not function.strict)
        backend_class(grammar_backend).check(GrammarKey("json_schema", schema.text))
    except GrammarError as e:
        raise openai_error(e, {e.param: param}) from None
    return Tool(function.name, definition.model_dump(exclude_none=True), schema)


def _check_unique(names: list[str]) -> None:
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"two tools are named {name!r}", param=f"tools[{i}].function.name")


def add_tool_grammar(params: dict[str, Any], plan: ToolPlan | None) -> dict[str, Any]:
    """The sampling dict with the tools' structural tag.

    Raises
    ------
    APIError: 400 when the request also asks for another output constraint.
    """
    if plan is None:
        return params
    given = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if k in params]
    if given:
        raise bad_request(f"tool calls cannot be combined with another output constraint ({given[0]}); "
                          'drop it or send tool_choice="none"', param="tool_choice")
    return {**params, "structural_tag": plan.structural_tag()}


# ---- the answer ----------------------------------------------------------------------


def tool_call_dict(call: ParsedCall) -> dict[str, Any]:
    """A call in OpenAI's `message.tool_calls` shape (arguments as JSON text)."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def checked_calls(plan: ToolPlan, parser: ToolCallParser, rid: str | None = None) -> CheckedCalls:
    """The calls to return, and why one had to be dropped.

    A call cut off (by `max_tokens` or a stop string) before its arguments
    were whole JSON is not returned, as vLLM and SGLang do; the finish_reason
    (`length`) says the answer was cut. A complete call whose arguments fail
    its schema (possible only for keywords the grammar leaves to validation)
    is dropped and logged, and the answer ends with `abort` and that reason.
    """
    kept, problems = [], []
    for call in parser.calls:
        if not call.complete:
            continue
        problem = plan.check_call(call)
        if problem is None:
            kept.append(call)
        else:
            logger.warning("request %s: tool call %s dropped: %s", rid, call.name, problem)
            problems.append(f"the call of {call.name} was dropped: {problem}")
    return CheckedCalls(kept, "; ".join(problems) or None)


@dataclass(frozen=True)
class CheckedCalls:
    """The calls of one answer that are returned, and why one was dropped (None when none was)."""

    calls: list[ParsedCall]
    dropped: str | None = None


def tool_finish_reason(reason: str | None, checked: CheckedCalls) -> str | None:
    """OpenAI's finish_reason: `tool_calls` when the answer ended after calling tools;
    `abort` when a call failed its schema; else the scheduler's reason."""
    if reason is None:
        return None
    if checked.dropped is not None:
        return "abort"
    if reason == "stop" and checked.calls:
        return "tool_calls"
    return reason


def tool_message(plan: ToolPlan, text: str, reason: str | None, rid: str | None = None
                 ) -> tuple[dict[str, Any], CheckedCalls, str | None]:
    """A non-streamed choice's `message`, its checked calls and finish_reason, from its whole output text.

    `content` is None only when the answer is tool calls alone.
    """
    parser = plan.parse(text)
    checked = checked_calls(plan, parser, rid)
    content = parser.content if checked.calls else parser.content or ""
    message = {"role": "assistant", "content": content,
               "tool_calls": [tool_call_dict(c) for c in checked.calls] or None}
    return message, checked, tool_finish_reason(reason, checked)


def delta_of(event: Event) -> dict[str, Any]:
    """One parser event as a streamed `delta`, the way OpenAI streams tool calls:
    the first delta of a call has its id, type, name and empty arguments; later
    ones carry argument fragments."""
    if isinstance(event, CallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    if isinstance(event, ArgumentsDelta):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    return {"content": event.text}
