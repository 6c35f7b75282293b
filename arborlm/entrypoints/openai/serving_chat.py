"""`POST /v1/chat/completions`: messages → chat template → n requests → OpenAI's answer.

Choices run concurrently; streamed, each choice opens with a role delta,
sends content deltas as tokens arrive and closes with a chunk that carries
`finish_reason` and `matched_stop`; with `stream_options.include_usage` a last
chunk with empty `choices` carries the usage, then `data: [DONE]`.

Each choice's text goes through `ChoiceText`: with `--reasoning-parser`
(`reasoning_parser.py`), the thinking goes to `reasoning_content` (deltas of
it when streaming) and only what follows it is content; with tools offered
(`tool_calls.py`, in the server's call format, `tool_parsers/`), the content
goes through the format's `ToolCallParser`: content deltas, then per call a
delta with its id and name and deltas of its argument text. A choice that
ends with finish_reason `abort` carries `abort_message`, why (an output that
failed its schema, a dropped tool call).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from arborlm.entrypoints.openai.chat_render import render_chat
from arborlm.entrypoints.openai.common import (
    OPENAI_RULES,
    TokenText,
    UsageCounter,
    abort_message,
    chat_logprobs,
    check_prompt_len,
    choice_rid,
    field_names,
    finish_reason,
    last_logprobs,
    max_new_tokens,
    new_id,
    now_s,
    openai_errors,
    parse_body,
    run_all,
    sampling_params,
    seeded,
    stream_all,
)
from arborlm.entrypoints.openai.protocol import ChatCompletionRequest
from arborlm.entrypoints.openai.reasoning_parser import (
    ReasoningMode,
    ReasoningParser,
    reasoning_mode,
    split_reasoning,
)
from arborlm.entrypoints.openai.serving_embeddings import refuse_generation
from arborlm.entrypoints.openai.tool_calls import (
    ToolPlan,
    add_tool_grammar,
    checked_calls,
    delta_of,
    plan_tools,
    tool_finish_reason,
    tool_message,
)
from arborlm.entrypoints.openai.tool_markers import (
    MarkerContinuation,
    run_continued,
    stream_continued,
)
from arborlm.entrypoints.openai.tool_parsers.base import ToolCallParser
from arborlm.entrypoints.openai.tool_parsers.registry import tool_call_format
from arborlm.entrypoints.request_builder import build_batch
from arborlm.entrypoints.server_state import get_state
from arborlm.entrypoints.streaming import (
    SSE_DONE,
    cancel_on_disconnect,
    primed,
    sse,
    sse_response,
)
from arborlm.runtime.io_struct import GenerateReqInput


@dataclass
class ChatCall:
    """What every chunk or answer of one call repeats."""

    id: str
    created: int
    model: str
    req: ChatCompletionRequest
    token_text: TokenText
    tools: ToolPlan | None = None
    report_cached: bool = False  # --enable-cache-report
    reasoning: ReasoningMode | None = None
    reasoning_parser: str | None = None  # --reasoning-parser: answers carry reasoning_content

    def choice_text(self) -> ChoiceText:
        """A fresh splitter for one choice's streamed text."""
        return ChoiceText(ReasoningParser(self.reasoning) if self.reasoning else None,
                          self.tools.new_parser() if self.tools else None)

    @property
    def top_n(self) -> int:
        return self.req.top_logprobs or 0

    def logprobs(self, tokens: list, tops: list) -> dict[str, Any] | None:
        return chat_logprobs(tokens, tops, self.token_text, self.top_n) if self.req.logprobs else None

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
               "model": self.model, "choices": choices}
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            out["usage"] = usage
        return out


async def chat_completions(request: Request) -> Response:
    """Answer one chat completion request (JSON, or SSE when `stream`)."""
    state = get_state(request)
    req = await parse_body(request, ChatCompletionRequest)
    state.check_model(req.model)
    refuse_generation(state)
    manager = state.live_manager()
    chat = state.server_args.chat
    fmt = tool_call_format(chat.tool_call_parser, getattr(state.tokenizer, "chat_template", None))
    plan = await asyncio.to_thread(plan_tools, req, state.server_args.grammar.grammar_backend, fmt)
    # Rendering a long conversation takes a while: a worker thread, so the loop serves others meanwhile.
    rendered = await asyncio.to_thread(
        render_chat, state.tokenizer, req.messages, req.continue_final_message, req.chat_template_kwargs,
        tools=plan.definitions if plan else None, fmt=fmt,
    )
    input_ids = rendered.input_ids
    context = state.model_info.context_length
    check_prompt_len(len(input_ids), context, "messages")
    limit_param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
    limit = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    mode = reasoning_mode(chat.reasoning_parser, rendered.text)
    params = add_tool_grammar(sampling_params(req, max_new_tokens(limit, len(input_ids), context, limit_param)), plan)
    params = _constrain_after_reasoning(params, mode)
    # Calls opened by a special token (Mistral's [TOOL_CALLS]) go on after it (tool_markers.py).
    markers = MarkerContinuation.of(plan, state.tokenizer)
    user_stops = list(params.get("stop_token_ids") or [])
    if markers is not None:
        params = markers.first_params(params)
    reqs = [
        GenerateReqInput(input_ids=input_ids, sampling_params=seeded(params, i), return_logprob=req.logprobs,
                         top_logprobs_num=req.top_logprobs or 0, stream=req.stream,
                         rid=choice_rid(req.rid, i, req.n), cache_salt=req.cache_salt)
        for i in range(req.n)
    ]
    call = ChatCall(new_id("chatcmpl", req.rid), now_s(), state.model_name, req, TokenText(state.tokenizer), plan,
                    report_cached=state.server_args.server.enable_cache_report,
                    reasoning=mode if req.separate_reasoning else None,
                    reasoning_parser=chat.reasoning_parser if req.separate_reasoning else None)
    with openai_errors(field_names(req)):
        built = await build_batch(manager, reqs, OPENAI_RULES)
        if req.stream:
            stream = (stream_all(manager, built) if markers is None
                      else stream_continued(manager, built, reqs, markers, user_stops))
            chunks = await cancel_on_disconnect(request, primed(stream))
            return sse_response(_stream(call, chunks))
        results = await cancel_on_disconnect(
            request, run_all(manager, built) if markers is None else run_continued(manager, built, reqs, markers,
                                                                                   user_stops))
    return JSONResponse(_answer(call, results))


_CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")


def _constrain_after_reasoning(params: dict[str, Any], mode: ReasoningMode | None) -> dict[str, Any]:
    """The sampling dict whose constraint (a `response_format`, the tools' grammar) starts after
    the reasoning: the reasoning itself is free text (`runtime/reasoning_grammar.py`)."""
    if mode is None or not any(k in params for k in _CONSTRAINTS):
        return params
    return {**params, "reasoning": mode.grammar_reasoning()}


def _answer(call: ChatCall, results: list[dict[str, Any]]) -> dict[str, Any]:
    usage = UsageCounter(report_cached=call.report_cached)
    choices = []
    for index, result in enumerate(results):
        meta = result["meta_info"]
        usage.add(meta, first_of_prompt=index == 0)
        tokens, tops = last_logprobs(meta, len(result["output_ids"]))
        reasoning, text = None, result["text"]
        if call.reasoning is not None:
            split = split_reasoning(call.reasoning, text)
            reasoning, text = split.reasoning, split.content
        message = {"role": "assistant", "content": text, "tool_calls": None}
        reason, why = finish_reason(meta), abort_message(meta)
        if call.tools is not None:
            message, checked, reason = tool_message(call.tools, text, reason, meta.get("id"))
            why = checked.dropped or why
        if call.reasoning_parser is not None:
            message["reasoning_content"] = reasoning
        choices.append({
            "index": index,
            "message": message,
            "logprobs": call.logprobs(tokens, tops),
            "finish_reason": reason,
            "matched_stop": meta.get("matched_stop"),
            **_abort_field(reason, why),
        })
    return {"id": call.id, "object": "chat.completion", "created": call.created, "model": call.model,
            "choices": choices, "usage": usage.to_dict()}


async def _stream(call: ChatCall, chunks: AsyncIterator[tuple[int, dict[str, Any]]]) -> AsyncIterator[str]:
    usage = UsageCounter(report_cached=call.report_cached)
    for index in range(call.req.n):
        yield sse(call.chunk([_delta(index, {"role": "assistant", "content": ""})]))
    texts = [call.choice_text() for _ in range(call.req.n)]
    async for index, chunk in chunks:
        meta = chunk["meta_info"]
        logprobs = call.logprobs(*last_logprobs(meta, len(chunk["output_ids"])))
        reason, why = finish_reason(meta), abort_message(meta)
        for delta in _with_logprobs(texts[index].deltas(chunk["text"], reason is not None), logprobs):
            yield sse(call.chunk([_delta(index, *delta)]))
        if reason is not None and call.tools is not None:
            checked = checked_calls(call.tools, texts[index].tools, meta.get("id"))
            reason, why = tool_finish_reason(reason, checked), checked.dropped or why
        if reason is not None:
            usage.add(meta, first_of_prompt=index == 0)
            last = _delta(index, {}, None, reason, meta.get("matched_stop"))
            yield sse(call.chunk([{**last, **_abort_field(reason, why)}]))
    if call.req.stream_options is not None and call.req.stream_options.include_usage:
        yield sse(call.chunk([], usage.to_dict()))
    yield SSE_DONE


class ChoiceText:
    """One streamed choice's text → OpenAI deltas: `reasoning_content`, `content`, `tool_calls`.

    reasoning: splits off the thinking (None without a reasoning parser).
    tools: reads tool calls out of the content (None without tools).
    """

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None):
        self.reasoning = reasoning
        self.tools = tools

    def deltas(self, text: str, last: bool) -> list[dict[str, Any]]:
        """The deltas of one chunk's `text`; `last`: the output ends with it (held-back text is sent)."""
        reasoning, content = "", text
        if self.reasoning is not None:
            parts = [self.reasoning.feed(text), *([self.reasoning.finish()] if last else [])]
            reasoning, content = "".join(p.reasoning for p in parts), "".join(p.content for p in parts)
        out = [{"reasoning_content": reasoning}] if reasoning else []
        if self.tools is None:
            return out + ([{"content": content}] if content else [])
        events = self.tools.feed(content) + (self.tools.finish() if last else [])
        return out + [delta_of(e) for e in events]


def _with_logprobs(deltas: list[dict[str, Any]], logprobs: dict[str, Any] | None
                   ) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """(delta, logprobs) pairs of one chunk; the chunk's logprobs ride on its first delta
    (an empty content delta when the chunk's text was all held back)."""
    if not deltas and logprobs and logprobs["content"]:
        deltas = [{"content": ""}]
    return [(d, logprobs if i == 0 else None) for i, d in enumerate(deltas)]


def _abort_field(reason: str | None, why: str | None) -> dict[str, Any]:
    """`abort_message` beside finish_reason `abort`: why the choice was cut short (OpenAI has no field for it)."""
    return {"abort_message": why} if reason == "abort" else {}


def _delta(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
           reason: str | None = None, matched_stop: Any = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
            "matched_stop": matched_stop}
