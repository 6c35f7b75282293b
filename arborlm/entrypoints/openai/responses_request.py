"""A Responses API request in the chat route's terms, and the chat route's errors in the Responses API's.

`call_chat_request` builds the `ChatCompletionRequest` that asks for the same
answer (flat function tools → chat tools, `text.format` → `response_format`,
`max_output_tokens` → `max_completion_tokens`); `constraint_params` adds the
output constraint, including tools beside a `text.format`, which the chat route
refuses; `responses_params` renames the fields the chat machinery's errors name
(``messages[4].content`` → ``input[2].content``, ``tools[0].function.parameters`` →
``tools[0].parameters``, ``response_format.json_schema.schema`` → ``text.format.schema``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from arborlm.constrained.json_schema import PreparedSchema, prepare_json_schema
from arborlm.constrained.keys import GrammarError, GrammarKey
from arborlm.constrained.registry import backend_class
from arborlm.entrypoints.http_errors import APIError, validation_error
from arborlm.entrypoints.openai.common import openai_error, sampling_params
from arborlm.entrypoints.openai.constraints import response_format_constraint
from arborlm.entrypoints.openai.protocol import ChatCompletionRequest
from arborlm.entrypoints.openai.responses_input import Conversation
from arborlm.entrypoints.openai.responses_protocol import FunctionTool, ResponsesRequest
from arborlm.entrypoints.openai.tool_calls import ToolPlan, add_tool_grammar


def call_chat_request(req: ResponsesRequest, conversation: Conversation) -> ChatCompletionRequest:
    """The chat completion request that asks for the same answer.

    Raises
    ------
    APIError: 400 naming `tools[i]` for a tool that is not a function (as chat fields; renamed by
        `responses_params`).
    """
    tools = [_chat_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None
    choice = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    body: dict[str, Any] = {
        "messages": conversation.messages, "tools": tools, "parallel_tool_calls": req.parallel_tool_calls,
        "tool_choice": choice if choice is None or isinstance(choice, str)
        else {"type": "function", "function": {"name": choice.name}},
        "max_completion_tokens": req.max_output_tokens,
        "response_format": None if fmt is None else {
            "type": fmt.type,
            **({"json_schema": {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
               if fmt.type == "json_schema" else {})},
        **{k: getattr(req, k) for k in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty",
                                        "stop", "user")},
    }
    return ChatCompletionRequest.model_validate(body)


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise APIError(400, f"tools of type {tool.get('type')!r} are not supported; this server calls "
                       "function tools", param=f"tools[{index}].type")
    try:
        function = FunctionTool.model_validate(tool)
    except ValidationError as e:
        raise validation_error([{**err, "loc": ("tools", index, *err["loc"])} for err in e.errors()]) from None
    return {"type": "function", "function": function.model_dump(exclude={"type"}, exclude_none=True)}


def constraint_params(chat_req: ChatCompletionRequest, plan: ToolPlan | None, limit: int, backend: str
                       ) -> tuple[dict[str, Any], PreparedSchema | None]:
    """The sampling dict with the output constraint, and the schema the finished text is checked
    against when the runtime does not check it.

    Tools and `text.format` may come together on this route (the Agents SDK sends both for an
    agent with an `output_type`): with ``tool_choice`` ``auto`` the answer is either calls or
    text of the format (an xgrammar ``or`` of the calls-only tag and the schema); a forced choice
    answers calls only, so the format has nothing to constrain.

    Raises
    ------
    APIError: 400 for a schema that cannot be served (naming `response_format.json_schema.schema`,
        renamed `text.format.schema` by `responses_params`).
    """
    fmt = response_format_constraint(chat_req.response_format)
    if plan is None or fmt is None:
        return add_tool_grammar(sampling_params(chat_req, limit), plan), None
    params = sampling_params(chat_req.model_copy(update={"response_format": None}), limit)
    if plan.choice != "auto":
        return {**params, "structural_tag": plan.structural_tag()}, None
    schema = _prepared(fmt.params, backend)
    calls = plan.format.structural_tag([t.spec for t in plan.tools], "required", plan.parallel)
    either = {"type": "or", "elements": [calls, {"type": "json_schema", "json_schema": json.loads(schema.text)}]}
    return {**params, "structural_tag": {"type": "structural_tag", "format": either}}, schema


def _prepared(params: dict[str, Any], backend: str) -> PreparedSchema:
    param = "response_format.json_schema.schema"
    try:
        schema = prepare_json_schema(params["json_schema"], lenient=params.get("json_schema_lenient", False))
        backend_class(backend).check(GrammarKey("json_schema", schema.text))
    except GrammarError as e:
        raise openai_error(e, {e.param: param}) from None
    return schema


# ---- error names ----------------------------------------------------------------------


# Chat request fields → the Responses fields they came from.
_RENAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("tool_choice.function.name", "tool_choice.name"),
    (".function.", "."),
)


def responses_param(param: str | None, sources: list[str]) -> str | None:
    """A chat request's field as the Responses request spells it (``messages[3].content`` →
    ``input[1].content`` when message 3 came from input item 1)."""
    if param is None:
        return None
    if param.startswith("messages["):
        index, _, rest = param[len("messages["):].partition("]")
        if index.isdigit() and int(index) < len(sources):
            source = sources[int(index)]
            # a message's own fields sit on its item; the text of a joined part is the item's content
            return source + rest if source.startswith("input[") else source
    if param == "messages":
        return "input"
    for old, new in _RENAMES:
        if param.startswith(old) or (old.startswith(".") and old in param):
            return param.replace(old, new, 1)
    return param


@contextlib.contextmanager
def responses_params(sources: list[str]) -> Iterator[None]:
    """Raise the chat machinery's 4xx errors with the Responses request's field names."""
    try:
        yield
    except APIError as e:
        param = responses_param(e.param, sources)
        message = e.message.replace(e.param, param) if e.param and param else e.message
        raise APIError(e.status, message, e.type, param, e.code) from None
