"""One call's prompts as single requests, and a validated batch run to completion.

The `Engine` and the native HTTP `/generate` both accept one prompt or a batch
(a list of texts or of token-id lists), one `sampling_params` dict or one per
prompt, and `n` samples per prompt. `expand_requests` turns that into a flat
list of `GenerateReqInput`; `generate_batch` validates every item before any
runs, then runs them together on the `TokenizerManager`'s loop; an item whose
grammar is refused reports it alone.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from arborlm.constrained.base import GrammarError
from arborlm.errors import EngineDeadError, InvalidRequestError
from arborlm.runtime.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from arborlm.runtime.tokenizer_manager import TokenizerManager
from arborlm.sampling_params import SamplingParams


def expand_requests(
    prompt: str | list[str] | None,
    input_ids: list[int] | list[list[int]] | None,
    sampling_params: dict | SamplingParams | list | None,
    prompt_param: str = "prompt",
    **kwargs: Any,
) -> tuple[list[GenerateReqInput], bool]:
    """Normalise one request or a batch into single requests, prompt by prompt.

    `n > 1` expands each prompt into n consecutive requests (seeds `seed + i`
    when a seed is given). `kwargs` are further `GenerateReqInput` fields.

    Returns
    -------
    (requests, is_batch): `is_batch` is True for a list of prompts or `n > 1`,
    i.e. when the caller answers with a list.

    Raises
    ------
    InvalidRequestError: both or neither of prompt and input_ids, an empty
        batch, a non-string prompt, mismatched `sampling_params`, a bad `n`.
    """
    if prompt is not None and input_ids is not None:
        raise InvalidRequestError(f"give {prompt_param} or input_ids, not both", param=prompt_param)
    if prompt is None and input_ids is None:
        raise InvalidRequestError(f"give {prompt_param} or input_ids", param=prompt_param)
    is_batch = isinstance(prompt, list) or (
        isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
    )
    given = prompt if prompt is not None else input_ids
    items = given if is_batch else [given]
    if is_batch and not items:
        raise InvalidRequestError("the batch is empty", param=prompt_param)
    if prompt is not None and not all(isinstance(p, str) for p in items):
        raise InvalidRequestError(f"{prompt_param} must be a string or a list of strings", param=prompt_param)
    reqs = []
    for item, params in zip(items, _params_per_item(sampling_params, len(items))):
        n = params.pop("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError("n must be an integer >= 1", param="n")
        for i in range(n):
            p = dict(params)
            if n > 1 and p.get("seed") is not None:
                p["seed"] = p["seed"] + i
            text, ids = (item, None) if prompt is not None else (None, item)
            reqs.append(GenerateReqInput(text=text, input_ids=ids, sampling_params=p, **kwargs))
    return reqs, is_batch or len(reqs) > 1


def _params_per_item(sampling_params: Any, num_items: int) -> list[dict[str, Any]]:
    """One fresh sampling dict per prompt."""
    if isinstance(sampling_params, list):
        if len(sampling_params) != num_items:
            raise InvalidRequestError("one sampling_params per prompt, or a single dict", param="sampling_params")
        params_list = sampling_params
    else:
        params_list = [sampling_params] * num_items
    dicts = []
    for params in params_list:
        if isinstance(params, SamplingParams):
            dicts.append(dict(params.__dict__))
        elif params is None or isinstance(params, dict):
            dicts.append(dict(params or {}))
        else:
            raise InvalidRequestError(
                f"sampling_params must be a dict or SamplingParams, got {type(params).__name__}",
                param="sampling_params",
            )
    return dicts


async def generate_batch(manager: TokenizerManager, reqs: list[GenerateReqInput]) -> list[dict[str, Any]]:
    """Run non-streaming requests together; one final result dict each, in order.

    Every item is validated and tokenized first, so a malformed one (bad
    prompt, bad sampling field) rejects the batch before anything runs.

    A grammar that cannot be used is the one per-item error, whether the front
    refuses it before queueing (bad schema or regex, a keyword the backend
    cannot enforce) or the scheduler later (compile failure or timeout): in a
    batch of more than one request, that item's result has no output and
    ``finish_reason`` ``{"type": "abort", "message", "param"}``, and the others
    run; a single request raises. Cancelling the caller aborts every item.

    Raises
    ------
    InvalidRequestError: a malformed item; or, for a single request, a refused grammar.
    ServerOverloadedError: the batch does not fit under `max_queued_requests`.
    EngineDeadError: the scheduler process is gone.
    """
    built: list[TokenizedGenerateReqInput | dict[str, Any]] = []
    for req in reqs:
        try:
            built.append(manager.build_request(req))
        except GrammarError as e:
            if len(reqs) == 1:
                raise
            rid = req.rid or uuid.uuid4().hex
            built.append(refused_result(rid, len(manager.prompt_ids(req)), e))
    rids = [r.rid if isinstance(r, TokenizedGenerateReqInput) else r["meta_info"]["id"] for r in built]
    if len(set(rids)) < len(rids):
        raise InvalidRequestError("request ids in one batch must be distinct", param="rid")
    manager.check_capacity(sum(isinstance(r, TokenizedGenerateReqInput) for r in built))

    return await run_built_batch(manager, built)


def rejected_result(req: TokenizedGenerateReqInput, error: InvalidRequestError) -> dict[str, Any]:
    """The result of a batch item the scheduler refused: no output, the reason in `finish_reason`."""
    return refused_result(req.rid, len(req.input_ids), error)


def refused_result(rid: str, prompt_tokens: int, error: InvalidRequestError) -> dict[str, Any]:
    """The result of a batch item whose grammar was refused: no output, the reason in `finish_reason`."""
    reason = {"type": "abort", "message": error.message, "param": error.param}
    meta = {"id": rid, "prompt_tokens": prompt_tokens, "completion_tokens": 0, "cached_tokens": 0,
            "finish_reason": reason, "matched_stop": None}
    return {"text": "", "output_ids": [], "meta_info": meta}


async def run_built_batch(
    manager: TokenizerManager, built: list[TokenizedGenerateReqInput | dict[str, Any]]
) -> list[dict[str, Any]]:
    """Run already-built requests together; one final result dict each, in order.

    An item that is already a result dict (refused before queueing) is returned as is.
    A request refused after queueing (a grammar that did not compile) reports it in
    its own result when the batch has more than one item, and raises when alone.

    Raises
    ------
    InvalidRequestError: a single request refused after queueing.
    EngineDeadError: the scheduler process is gone.
    """

    async def one(req: TokenizedGenerateReqInput | dict[str, Any]) -> dict[str, Any]:
        if not isinstance(req, TokenizedGenerateReqInput):
            return req  # refused before queueing
        try:
            async for result in manager.generate(req):
                return result
        except InvalidRequestError as e:
            # Refused after queueing (a grammar that did not compile): in a batch, that
            # item alone reports it and the others keep their results.
            if len(built) == 1:
                raise
            return rejected_result(req, e)
        raise EngineDeadError("no result")

    return list(await asyncio.gather(*(one(r) for r in built)))
