"""`POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`: OpenAI's Responses API.

A request is answered by the chat route's machinery: its input items become
chat messages (`responses_input.py`), which are rendered by the model's chat
template with the offered tools (`chat_render.render_chat`,
`tool_calls.plan_tools`: the server's call format, arguments valid by grammar),
`text.format` is the chat route's `response_format` (a `json_schema`
constraint, validated when finished), and the thinking of a reasoning model is
split off by the `--reasoning-parser`. One request goes to the scheduler; its
text becomes output items (`responses_output.py`). With `stream`, the answer
is the Responses event stream: ``response.created``, ``response.in_progress``,
the items' events, then ``response.completed`` (or ``.incomplete`` when
`max_output_tokens` cut the output, ``.failed`` when it was aborted), each
event with its `sequence_number`.

`store` (the default) keeps the response in the app's `ResponseStore`;
`previous_response_id` renders the stored conversation first, so the prompt
extends the previous one and its KV comes from the radix cache
(`usage.input_tokens_details.cached_tokens` counts it with
`--enable-cache-report`). As OpenAI's, the stream ends without ``data: [DONE]``. Errors are the chat route's, naming the Responses
fields (`input[2].content`, `tools[0].parameters`, `text.format.schema`,
`max_output_tokens`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from arborlm.constrained.json_schema import PreparedSchema, validate_json_output
from arborlm.entrypoints.http_errors import bad_request
from arborlm.entrypoints.openai.chat_render import RenderedChat, render_chat
from arborlm.entrypoints.openai.common import (
    OPENAI_RULES,
    abort_message,
    check_prompt_len,
    field_names,
    finish_reason,
    max_new_tokens,
    now_s,
    openai_errors,
    parse_body,
    run_all,
    stream_all,
)
from arborlm.entrypoints.openai.reasoning_parser import (
    ReasoningMode,
    ReasoningParser,
    reasoning_mode,
)
from arborlm.entrypoints.openai.response_store import ResponseStore, StoredResponse
from arborlm.entrypoints.openai.responses_input import (
    Conversation,
    assistant_message,
    build_conversation,
)
from arborlm.entrypoints.openai.responses_output import Finished, OutputBuilder, item_id
from arborlm.entrypoints.openai.responses_protocol import ResponsesRequest
from arborlm.entrypoints.openai.responses_request import (
    call_chat_request,
    constraint_params,
    responses_params,
)
from arborlm.entrypoints.openai.serving_embeddings import refuse_generation
from arborlm.entrypoints.openai.tool_calls import ToolPlan, plan_tools
from arborlm.entrypoints.openai.tool_parsers.registry import tool_call_format
from arborlm.entrypoints.request_builder import build_batch
from arborlm.entrypoints.server_state import ServerState, get_state
from arborlm.entrypoints.streaming import cancel_on_disconnect, primed, sse, sse_response
from arborlm.runtime.io_struct import GenerateReqInput

router = APIRouter()


def response_store(request: Request) -> ResponseStore:
    """The app's store (`http_server.create_app` puts one in `app.state.responses`)."""
    return request.app.state.responses


# ---- the call ------------------------------------------------------------------


@dataclass
class ResponseCall:
    """One response being made: the request, what it was rendered from, and how its text is read."""

    id: str
    created_at: int
    model: str
    req: ResponsesRequest
    conversation: Conversation
    plan: ToolPlan | None
    reasoning: ReasoningMode | None
    report_cached: bool
    tokenizer: Any
    text_schema: PreparedSchema | None = None  # text.format beside tools: checked here, not by the runtime

    def builder(self) -> OutputBuilder:
        return OutputBuilder(ReasoningParser(self.reasoning) if self.reasoning else None, self.plan)

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
             error: dict[str, Any] | None = None, incomplete: dict[str, Any] | None = None) -> dict[str, Any]:
        """The `Response` object, OpenAI's fields echoing the request."""
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "output": output, "error": error, "incomplete_details": incomplete,
            "instructions": req.instructions, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "tool_choice": _tool_choice(req), "tools": req.tools or [],
            "text": {"format": _text_format(req)}, "previous_response_id": req.previous_response_id,
            "store": req.store, "background": False, "truncation": "disabled", "user": req.user,
            "usage": usage,
        }

    def final(self, meta: dict[str, Any], done: Finished) -> dict[str, Any]:
        """The finished `Response`: status from the finish reason (and the calls' check), usage."""
        reason = finish_reason(meta)
        why = done.dropped or abort_message(meta)
        if why is None and reason == "stop" and self.text_schema is not None and done.text:
            problem = validate_json_output(self.text_schema, done.text)
            why = None if problem is None else f"the output text does not satisfy text.format: {problem}"
        error = incomplete = None
        if why is not None:
            status, error = "failed", {"code": "server_error", "message": why}
        elif reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            status = "completed"
        return self.body(status, done.output, self.usage(meta, done), error, incomplete)

    def usage(self, meta: dict[str, Any], done: Finished) -> dict[str, Any]:
        """Token counts; `cached_tokens` only with `--enable-cache-report` (0 otherwise, as on the chat
        route: the real count tells a client which prefixes others sent). `reasoning_tokens` is the
        reasoning text re-encoded."""
        reasoning = len(self.tokenizer.encode(done.reasoning, add_special_tokens=False)) if done.reasoning else 0
        prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": meta["cached_tokens"] if self.report_cached else 0,
                                         "cache_write_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": min(reasoning, completion)},
                "total_tokens": prompt + completion}

    def stored(self, body: dict[str, Any], done: Finished) -> StoredResponse:
        """What `previous_response_id` continues: this conversation and its answer."""
        conv = self.conversation.extended("previous_response_id")
        conv.messages = [m for m, s in zip(self.conversation.messages, self.conversation.sources)
                         if s != "instructions"]
        conv.sources = ["previous_response_id"] * len(conv.messages)
        conv.messages.append(assistant_message(done.text, done.calls))
        conv.sources.append("previous_response_id")
        for call in done.calls:
            conv.calls[call["id"]] = call["function"]["name"]
        return StoredResponse(body, conv)


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else {"type": "function", "name": choice.name}


def _text_format(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)


# ---- routes --------------------------------------------------------------------


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    """Answer one Responses request (a `Response` object, or its event stream when `stream`)."""
    state = get_state(request)
    req = await parse_body(request, ResponsesRequest)
    state.check_model(req.model)
    if req.background:  # vLLM and SGLang queue it and answer `queued`; arborlm answers in the request
        raise bad_request("background responses are not supported: send background false (the default) "
                          "and wait for the answer, or stream it", param="background")
    refuse_generation(state)
    manager = state.live_manager()
    store = response_store(request)
    previous = store.get(req.previous_response_id, "previous_response_id").conversation \
        if req.previous_response_id is not None else None
    conversation = build_conversation(req.input, req.instructions, previous)
    with responses_params(conversation.sources):
        call, built, names = await _prepare(state, req, conversation)
        with openai_errors(names):
            items = await build_batch(manager, built, OPENAI_RULES)
            if req.stream:
                chunks = await cancel_on_disconnect(request, primed(stream_all(manager, items)))
                return sse_response(_stream(call, chunks, store))
            results = await cancel_on_disconnect(request, run_all(manager, items))
    result = results[0]
    builder = call.builder()
    builder.feed(result["text"], last=True)
    done = builder.finish()
    body = call.final(result["meta_info"], done)
    if req.store:
        store.put(call.stored(body, done))
    return JSONResponse(body)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> dict[str, Any]:
    """A stored response; 404 ``response_not_found`` for an unknown, deleted or evicted id."""
    return response_store(request).get(response_id).body


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
    """Forget a stored response; 404 ``response_not_found`` for an unknown id."""
    response_store(request).delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


# ---- preparing the request ----------------------------------------------------------


async def _prepare(state: ServerState, req: ResponsesRequest, conversation: Conversation
                   ) -> tuple[ResponseCall, list[GenerateReqInput], dict[str, str]]:
    """Render the prompt and build the one generation request, as the chat route does; the
    native field names of its constraint (`common.field_names`) come third."""
    chat_req = call_chat_request(req, conversation)
    chat = state.server_args.chat
    fmt = tool_call_format(chat.tool_call_parser, getattr(state.tokenizer, "chat_template", None))
    plan = await asyncio.to_thread(plan_tools, chat_req, state.server_args.grammar.grammar_backend, fmt)
    rendered: RenderedChat = await asyncio.to_thread(
        render_chat, state.tokenizer, chat_req.messages, False, None,
        tools=plan.definitions if plan else None, fmt=fmt)
    context = state.model_info.context_length
    check_prompt_len(len(rendered.input_ids), context, "messages")
    limit = max_new_tokens(chat_req.max_completion_tokens, len(rendered.input_ids), context,
                           "max_completion_tokens")
    mode = reasoning_mode(chat.reasoning_parser, rendered.text)
    params, text_schema = constraint_params(chat_req, plan, limit, state.server_args.grammar.grammar_backend)
    if mode is not None and any(k in params for k in ("json_schema", "regex", "ebnf", "structural_tag")):
        params = {**params, "reasoning": mode.grammar_reasoning()}  # the constraint starts after the thinking
    call = ResponseCall(item_id("resp"), now_s(), state.model_name, req, conversation, plan, mode,
                        state.server_args.server.enable_cache_report, state.tokenizer, text_schema)
    gen = GenerateReqInput(input_ids=rendered.input_ids, sampling_params=params, stream=req.stream)
    return call, [gen], field_names(chat_req)


# ---- streaming -----------------------------------------------------------------------


async def _stream(call: ResponseCall, chunks: AsyncIterator[tuple[int, dict[str, Any]]],
                  store: ResponseStore) -> AsyncIterator[str]:
    """The Responses event stream of one call (see the module docstring)."""
    sequence = iter(range(1 << 62))

    def event(payload: dict[str, Any]) -> str:
        return sse({**payload, "sequence_number": next(sequence)})

    started = call.body("in_progress", [])
    yield event({"type": "response.created", "response": started})
    yield event({"type": "response.in_progress", "response": started})
    builder = call.builder()
    async for _, chunk in chunks:
        meta = chunk["meta_info"]
        last = finish_reason(meta) is not None
        for payload in builder.feed(chunk["text"], last):
            yield event(payload)
        if last:
            done = builder.finish()
            body = call.final(meta, done)
            if call.req.store:
                store.put(call.stored(body, done))
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                body["status"], "response.failed")
            yield event({"type": kind, "response": body})
