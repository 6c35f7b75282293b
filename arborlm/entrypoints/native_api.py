"""SGLang's native API: `/generate`, health, model and server info, cache flush,
abort, and Prometheus `/metrics`.

`/generate` answers SGLang's result dicts (`{"text", "output_ids", "meta_info"}`),
a list for a batch or `n > 1`. Streamed, each event carries the text and ids
*so far* (SGLang's default, not deltas), plus `index` in a batch; the last one
has `meta_info.finish_reason`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from arborlm.chat_template import ChatTemplate
from arborlm.entrypoints.auth import require_admin
from arborlm.entrypoints.http_errors import APIError, bad_request
from arborlm.entrypoints.openai.common import TokenText, parse_body
from arborlm.entrypoints.openai.protocol import AbortRequest, GenerateRequest
from arborlm.entrypoints.request_builder import (
    BatchItem,
    BatchRules,
    ContextLengthError,
    build_batch,
    expand_requests,
    generate_batch,
    run_built_batch,
)
from arborlm.entrypoints.server_state import ServerState, get_state
from arborlm.entrypoints.sglang_fields import UnsupportedFieldError, check_extra_fields
from arborlm.entrypoints.streaming import (
    SSE_DONE,
    cancel_on_disconnect,
    merge_streams,
    primed,
    sse,
    sse_response,
)
from arborlm.runtime.io_struct import GenerateReqInput
from arborlm.runtime.tokenizer_manager import TokenizerManager
from arborlm.version import __version__

HEALTH_GENERATE_TIMEOUT_S = 20.0

router = APIRouter()


# ---- generation --------------------------------------------------------------


@router.post("/generate")
async def generate(request: Request) -> Response:
    """SGLang's `/generate`: text or input_ids, one or a batch; JSON or SSE."""
    state = get_state(request)
    body = await parse_body(request, GenerateRequest)
    try:
        check_extra_fields(body.model_extra)
    except UnsupportedFieldError as e:
        raise bad_request(e.message, param=e.param) from None
    manager = state.live_manager()
    prompt_param = "text" if body.text is not None or body.input_ids is None else "input_ids"
    reqs, is_batch = expand_requests(
        body.text, body.input_ids, body.sampling_params, prompt_param=prompt_param,
        return_logprob=body.return_logprob, logprob_start_len=body.logprob_start_len,
        top_logprobs_num=body.top_logprobs_num, stream=body.stream, cache_salt=body.cache_salt,
    )
    _assign_rids(reqs, body.rid)
    rules = BatchRules(check_context=True, never_fits_param=prompt_param if _num_prompts(body) > 1 else "n")
    built = await _build(manager, reqs, rules)
    token_text = TokenText(state.tokenizer) if body.return_text_in_logprobs else None
    report_cached = state.server_args.server.enable_cache_report
    if body.stream:
        merged = merge_streams([manager.generate(b) for b in built])
        chunks = await cancel_on_disconnect(request, primed(merged))
        return sse_response(_stream(chunks, is_batch, token_text, report_cached))
    results = await cancel_on_disconnect(request, run_built_batch(manager, built))
    results = [_cache_report(_with_token_text(r, token_text), report_cached) for r in results]
    return JSONResponse(results if is_batch else results[0])


def _num_prompts(body: GenerateRequest) -> int:
    if isinstance(body.text, list):
        return len(body.text)
    if body.input_ids and isinstance(body.input_ids[0], list):
        return len(body.input_ids)
    return 1


async def _build(manager: TokenizerManager, reqs: list[GenerateReqInput], rules: BatchRules) -> list[BatchItem]:
    """`build_batch`, with prompt + an explicit `max_new_tokens` over the context answered as
    OpenAI's 400 `context_length_exceeded` (the other errors map to their status as they are).

    Raises
    ------
    APIError: 400 `context_length_exceeded`.
    InvalidRequestError, ServerOverloadedError: as `build_batch` raises them.
    """
    try:
        return await build_batch(manager, reqs, rules)
    except ContextLengthError as e:
        raise bad_request(e.message, param=e.param, code=e.code) from None


def _assign_rids(reqs: list[GenerateReqInput], rid: str | list[str] | None) -> None:
    """One rid for a single request, or one per request of a batch (`build_batch` checks they differ)."""
    if rid is None:
        return
    rids = [rid] if isinstance(rid, str) else rid
    if len(rids) != len(reqs):
        raise bad_request(f"rid gives {len(rids)} id(s) for {len(reqs)} request(s) (prompts x n)", param="rid")
    for req, one in zip(reqs, rids):
        req.rid = one


async def _stream(chunks: AsyncIterator[tuple[int, dict[str, Any]]], is_batch: bool,
                  token_text: TokenText | None, report_cached: bool) -> AsyncIterator[str]:
    """Cumulative text and ids per request, as SGLang streams them."""
    text: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    async for index, chunk in chunks:
        text[index] = text.get(index, "") + chunk["text"]
        ids.setdefault(index, []).extend(chunk["output_ids"])
        out = _with_token_text({**chunk, "text": text[index], "output_ids": list(ids[index])}, token_text)
        out = _cache_report(out, report_cached)
        if is_batch:
            out["index"] = index
        yield sse(out)
    yield SSE_DONE


def _cache_report(result: dict[str, Any], report_cached: bool) -> dict[str, Any]:
    """`meta_info.cached_tokens` as 0 unless `--enable-cache-report`: the real count tells a
    client which prompt prefixes other clients sent. The key stays, as SGLang's clients read it."""
    if report_cached or not result["meta_info"].get("cached_tokens"):
        return result
    return {**result, "meta_info": {**result["meta_info"], "cached_tokens": 0}}


def _with_token_text(result: dict[str, Any], token_text: TokenText | None) -> dict[str, Any]:
    """Fill each (logprob, token_id, None) triple's text when `return_text_in_logprobs`."""
    if token_text is None:
        return result
    meta = dict(result["meta_info"])
    for key in ("output_token_logprobs", "input_token_logprobs"):
        if meta.get(key):
            meta[key] = [(lp, tid, token_text(tid)) for lp, tid, _ in meta[key]]
    for key in ("output_top_logprobs", "input_top_logprobs"):
        if meta.get(key):
            meta[key] = [None if top is None else [(lp, tid, token_text(tid)) for lp, tid, _ in top]
                         for top in meta[key]]
    return {**result, "meta_info": meta}


# ---- health and info ---------------------------------------------------------


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the scheduler is alive and the server takes requests, else 503."""
    state = get_state(request)
    manager = state.live_manager()
    if manager.dead_reason is not None:
        raise APIError(503, manager.dead_reason, type="server_error", code="engine_dead")
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 when the server generates one token (an embedding server: embeds one) within the timeout, else 503."""
    state = get_state(request)
    manager = state.live_manager()
    tokens = 0 if state.server_args.model.is_embedding else 1  # an embedding server runs prefill-only requests
    req = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": tokens, "temperature": 0},
                           rid=f"health-{uuid.uuid4().hex}")
    try:
        await asyncio.wait_for(generate_batch(manager, [req]), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise APIError(503, "the server did not generate a token in time", type="server_error") from None
    return Response(status_code=200)


@router.get("/get_model_info")
@router.get("/model_info", operation_id="model_info")  # SGLang's current name (sglang-router probes it)
async def get_model_info(request: Request) -> dict[str, Any]:
    """SGLang's model facts, plus `chat_template_roles`: the text before and after
    each role's content ({role: [prefix, suffix]}), which `RuntimeEndpoint` uses to
    render DSL programs exactly as the in-process backend does."""
    state = get_state(request)
    info = state.model_info
    return {
        "model_path": state.server_args.model.model_path or info.checkpoint,
        "tokenizer_path": info.checkpoint,
        "served_model_name": state.model_name,
        "is_generation": not state.server_args.model.is_embedding,
        "chat_template_roles": _chat_template_roles(state.tokenizer),
        **info.__dict__,
    }


def _chat_template_roles(tokenizer) -> dict[str, list[str]] | None:
    """Role markers of the model's chat template; None when the template cannot be cut into them."""
    try:
        template = ChatTemplate.from_tokenizer(tokenizer)
    except Exception:  # noqa: BLE001 - a template that refuses the probe messages (jinja raises anything)
        return None
    return {role: list(pair) for role, pair in template.role_prefix_and_suffix.items()}


@router.get("/get_server_info")
@router.get("/server_info", operation_id="server_info")  # SGLang's current name (sglang-router probes it)
async def get_server_info(request: Request) -> dict[str, Any]:
    """Server args, model facts and live figures (running/queued requests, KV slots, cache hit rate).

    `model_path` is the checkpoint actually loaded (never null: sglang-router names the
    worker's model from it) and `served_model_name` the name the OpenAI routes answer to.
    """
    state = get_state(request)
    manager = state.live_manager()
    live = await manager.get_info()
    return {**_public_args(state), **state.model_info.__dict__, **live,
            "model_path": state.server_args.model.model_path or state.model_info.checkpoint,
            "served_model_name": state.model_name,
            "num_in_flight_reqs": len(manager.rid_to_state), "version": __version__}


def _public_args(state: ServerState) -> dict[str, Any]:
    return state.server_args.public_dict()  # the API keys redacted


# ---- control -----------------------------------------------------------------


# One route per method, each with its own OpenAPI operation id (one route with two methods repeats the id).
@router.get("/flush_cache", operation_id="flush_cache_get")
@router.post("/flush_cache", operation_id="flush_cache_post")
async def flush_cache(request: Request) -> dict[str, Any]:
    """Empty the radix cache; 400 while requests are in flight. An admin route (`auth`)."""
    require_admin(request)
    if not await get_state(request).live_manager().flush_cache():
        raise bad_request("the cache cannot be flushed while requests are in flight")
    return {"success": True, "message": "Cache flushed."}


@router.post("/abort_request")
async def abort_request(request: Request) -> dict[str, Any]:
    """Abort one request by id (`{"rid": ...}`) or all (`{"abort_all": true}`, an admin
    route: `auth`); unknown ids are ignored."""
    body = await parse_body(request, AbortRequest)
    if body.abort_all:
        require_admin(request)
    manager = get_state(request).live_manager()
    rids = list(manager.rid_to_state) if body.abort_all else [body.rid]
    for rid in rids:
        await manager.abort_request(rid)
    return {"success": True}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    state = get_state(request)
    state.metrics.update_from_scheduler(await state.live_manager().get_info())
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
