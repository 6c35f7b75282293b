"""`POST /v1/completions`: prompts (text or token ids, one or many) × n → OpenAI's answer.

Choice `index` is `prompt_index * n + i`, as OpenAI numbers them. `echo` and
`suffix` are refused: the server returns only generated text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from arborlm.entrypoints.http_errors import bad_request
from arborlm.entrypoints.openai.common import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    OPENAI_RULES,
    TokenText,
    UsageCounter,
    abort_message,
    check_prompt_len,
    choice_rid,
    completion_logprobs,
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
from arborlm.entrypoints.openai.protocol import CompletionRequest
from arborlm.entrypoints.request_builder import build_batch
from arborlm.entrypoints.request_builder import check_fan_out as check_num_reqs
from arborlm.entrypoints.server_state import ServerState, get_state
from arborlm.entrypoints.streaming import (
    SSE_DONE,
    cancel_on_disconnect,
    primed,
    sse,
    sse_response,
)
from arborlm.runtime.io_struct import GenerateReqInput


def check_unsupported(req: CompletionRequest) -> None:
    """Refuse the fields this server does not serve, clearly."""
    if req.echo:
        raise bad_request("echo is not supported by this server", param="echo")
    if req.suffix:
        raise bad_request("suffix (insertion) is not supported by this server", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (other than best_of == n)", param="best_of")


def check_fan_out(num_prompts: int, n: int) -> None:
    """Refuse prompts x n above `request_builder.MAX_REQS_PER_CALL` before any request is made.

    Raises
    ------
    APIError: 400 naming ``n``, as the OpenAI routes name the other limits of n.
    """
    with openai_errors():
        check_num_reqs(num_prompts, num_prompts * n, "n")


def prompt_ids(state: ServerState, prompt: Any) -> list[list[int]]:
    """Each prompt's token ids; strings are tokenized without special tokens.

    Raises
    ------
    APIError: 400 for an empty list or an empty prompt.
    """
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt is an empty list", param="prompt")
    tokenize = state.manager.tokenize
    return [tokenize(p) if isinstance(p, str) else list(p) for p in items]


@dataclass
class CompletionCall:
    """What every chunk or answer of one call repeats."""

    id: str
    created: int
    model: str
    req: CompletionRequest
    token_text: TokenText
    text_offsets: dict[int, int] = field(default_factory=dict)
    report_cached: bool = False  # --enable-cache-report

    def logprobs(self, index: int, tokens: list, tops: list) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        out = completion_logprobs(tokens, tops, self.token_text, self.req.logprobs, self.text_offsets.get(index, 0))
        if out["text_offset"]:
            self.text_offsets[index] = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    def body(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {"id": self.id, "object": "text_completion", "created": self.created,
               "model": self.model, "choices": choices}
        if not self.req.stream or (self.req.stream_options is not None and self.req.stream_options.include_usage):
            out["usage"] = usage
        return out


async def completions(request: Request) -> Response:
    """Answer one completion request (JSON, or SSE when `stream`)."""
    state = get_state(request)
    req = await parse_body(request, CompletionRequest)
    state.check_model(req.model)
    manager = state.live_manager()
    check_unsupported(req)
    context = state.model_info.context_length
    prompts = prompt_ids(state, req.prompt)
    check_fan_out(len(prompts), req.n)
    total = len(prompts) * req.n
    requested = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    reqs = []
    for ids in prompts:
        check_prompt_len(len(ids), context, "prompt")
        params = sampling_params(req, max_new_tokens(requested, len(ids), context, "max_tokens"))
        for i in range(req.n):
            reqs.append(GenerateReqInput(
                input_ids=ids, sampling_params=seeded(params, i), return_logprob=req.logprobs is not None,
                top_logprobs_num=req.logprobs or 0, stream=req.stream,
                rid=choice_rid(req.rid, len(reqs), total), cache_salt=req.cache_salt,
            ))
    call = CompletionCall(new_id("cmpl", req.rid), now_s(), state.model_name, req, TokenText(state.tokenizer),
                          report_cached=state.server_args.server.enable_cache_report)
    with openai_errors(field_names(req)):
        built = await build_batch(manager, reqs, OPENAI_RULES)
        if req.stream:
            chunks = await cancel_on_disconnect(request, primed(stream_all(manager, built)))
            return sse_response(_stream(call, chunks))
        results = await cancel_on_disconnect(request, run_all(manager, built))
    return JSONResponse(_answer(call, results))


def _answer(call: CompletionCall, results: list[dict[str, Any]]) -> dict[str, Any]:
    usage = UsageCounter(report_cached=call.report_cached)
    choices = []
    for index, result in enumerate(results):
        meta = result["meta_info"]
        usage.add(meta, first_of_prompt=index % call.req.n == 0)
        tokens, tops = last_logprobs(meta, len(result["output_ids"]))
        choices.append(_choice(index, result["text"], call.logprobs(index, tokens, tops),
                               finish_reason(meta), meta.get("matched_stop"), abort_message(meta)))
    return call.body(choices, usage.to_dict())


async def _stream(call: CompletionCall, chunks: AsyncIterator[tuple[int, dict[str, Any]]]) -> AsyncIterator[str]:
    usage = UsageCounter(report_cached=call.report_cached)
    async for index, chunk in chunks:
        meta = chunk["meta_info"]
        logprobs = call.logprobs(index, *last_logprobs(meta, len(chunk["output_ids"])))
        if chunk["text"] or (logprobs and logprobs["tokens"]):
            yield sse(call.body([_choice(index, chunk["text"], logprobs)]))
        reason = finish_reason(meta)
        if reason is not None:
            usage.add(meta, first_of_prompt=index % call.req.n == 0)
            yield sse(call.body([_choice(index, "", None, reason, meta.get("matched_stop"), abort_message(meta))]))
    if call.req.stream_options is not None and call.req.stream_options.include_usage:
        yield sse(call.body([], usage.to_dict()))
    yield SSE_DONE


def _choice(index: int, text: str, logprobs: dict[str, Any] | None, reason: str | None = None,
            matched_stop: Any = None, why: str | None = None) -> dict[str, Any]:
    """One choice; an aborted one says why in `abort_message` (OpenAI has no field for it)."""
    out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
           "matched_stop": matched_stop}
    if reason == "abort":
        out["abort_message"] = why
    return out
