"""`POST /v1/chat/completions`: messages → chat template → n requests → OpenAI's answer.

Choices run concurrently; streamed, each choice opens with a role delta,
sends content deltas as tokens arrive and closes with a chunk that carries
`finish_reason` and `matched_stop`; with `stream_options.include_usage` a last
chunk with empty `choices` carries the usage, then `data: [DONE]`. With tools
offered (`tool_calls.py`), each choice's text goes through a `ToolCallParser`:
content deltas, then per call a delta with its id and name and deltas of its
argument text. A choice that ends with finish_reason `abort` carries
`abort_message`, why (an output that failed its schema, a dropped tool call).
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
from arborlm.entrypoints.openai.tool_calls import (
    ToolPlan,
    add_tool_grammar,
    checked_calls,
    delta_of,
    plan_tools,
    tool_finish_reason,
    tool_message,
)
from arborlm.entrypoints.openai.tool_parser import ToolCallParser
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
    manager = state.live_manager()
    plan = await asyncio.to_thread(plan_tools, req, state.server_args.grammar.grammar_backend)
    # Rendering a long conversation takes a while: a worker thread, so the loop serves others meanwhile.
    input_ids = await asyncio.to_thread(
        render_chat, state.tokenizer, req.messages, req.continue_final_message, req.chat_template_kwargs,
        tools=plan.definitions if plan else None,
    )
    context = state.model_info.context_length
    check_prompt_len(len(input_ids), context, "messages")
    limit_param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
    limit = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    params = add_tool_grammar(sampling_params(req, max_new_tokens(limit, len(input_ids), context, limit_param)), plan)
    reqs = [
        GenerateReqInput(input_ids=input_ids, sampling_params=seeded(params, i), return_logprob=req.logprobs,
                         top_logprobs_num=req.top_logprobs or 0, stream=req.stream,
                         rid=choice_rid(req.rid, i, req.n), cache_salt=req.cache_salt)
        for i in range(req.n)
    ]
    call = ChatCall(new_id("chatcmpl", req.rid), now_s(), state.model_name, req, TokenText(state.tokenizer), plan,
                    report_cached=state.server_args.server.enable_cache_report)
    with openai_errors(field_names(req)):
        built = await build_batch(manager, reqs, OPENAI_RULES)
        if req.stream:
            chunks = await cancel_on_disconnect(request, primed(stream_all(manager, built)))
            return sse_response(_stream(call, chunks))
        results = await cancel_on_disconnect(request, run_all(manager, built))
    return JSONResponse(_answer(call, results))


def _answer(call: ChatCall, results: list[dict[str, Any]]) -> dict[str, Any]:
    usage = UsageCounter(report_cached=call.report_cached)
    choices = []
    for index, result in enumerate(results):
        meta = result["meta_info"]
        usage.add(meta, first_of_prompt=index == 0)
        tokens, tops = last_logprobs(meta, len(result["output_ids"]))
        message = {"role": "assistant", "content": result["text"], "tool_calls": None}
        reason, why = finish_reason(meta), abort_message(meta)
        if call.tools is not None:
            message, checked, reason = tool_message(call.tools, result["text"], reason, meta.get("id"))
            why = checked.dropped or why
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
    parsers = [ToolCallParser() for _ in range(call.req.n)] if call.tools is not None else None
    async for index, chunk in chunks:
        meta = chunk["meta_info"]
        logprobs = call.logprobs(*last_logprobs(meta, len(chunk["output_ids"])))
        reason, why = finish_reason(meta), abort_message(meta)
        if parsers is None:
            if chunk["text"] or (logprobs and logprobs["content"]):
                yield sse(call.chunk([_delta(index, {"content": chunk["text"]}, logprobs)]))
        else:
            for delta in _tool_deltas(parsers[index], chunk["text"], reason is not None, logprobs):
                yield sse(call.chunk([_delta(index, *delta)]))
            if reason is not None:
                checked = checked_calls(call.tools, parsers[index], meta.get("id"))
                reason, why = tool_finish_reason(reason, checked), checked.dropped or why
        if reason is not None:
            usage.add(meta, first_of_prompt=index == 0)
            last = _delta(index, {}, None, reason, meta.get("matched_stop"))
            yield sse(call.chunk([{**last, **_abort_field(reason, why)}]))
    if call.req.stream_options is not None and call.req.stream_options.include_usage:
        yield sse(call.chunk([], usage.to_dict()))
    yield SSE_DONE


def _abort_field(reason: str | None, why: str | None) -> dict[str, Any]:
    """`abort_message` beside finish_reason `abort`: why the choice was cut short (OpenAI has no field for it)."""
    return {"abort_message": why} if reason == "abort" else {}


def _delta(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
           reason: str | None = None, matched_stop: Any = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
            "matched_stop": matched_stop}


def _tool_deltas(parser: ToolCallParser, text: str, last: bool, logprobs: dict[str, Any] | None
                 ) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """(delta, logprobs) pairs of one chunk's text; the chunk's logprobs ride on its first delta."""
    events = parser.feed(text) + (parser.finish() if last else [])
    deltas = [delta_of(e) for e in events]
    if not deltas and logprobs and logprobs["content"]:
        deltas = [{"content": ""}]
    return [(d, logprobs if i == 0 else None) for i, d in enumerate(deltas)]
