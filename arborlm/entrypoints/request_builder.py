"""One call's prompts as single requests, built and checked together before any runs.

The `Engine` and the native HTTP `/generate` both accept one prompt or a batch
(a list of texts or of token-id lists), one `sampling_params` dict or one per
prompt, and `n` samples per prompt. `expand_requests` turns that into a flat
list of `GenerateReqInput`.

`build_batch` is the one path by which the Engine, the native routes and the
OpenAI routes turn those into `TokenizedGenerateReqInput`s: distinct request
ids, a call the server can ever hold, every item validated and tokenized in a
worker thread, the context (where the entry point asks for it), room in the
queue now. What differs between entry points is a `BatchRules`; the errors are
typed (`InvalidRequestError` subclasses here), and each entry point gives them
its own shape (an OpenAI-style 400, a native 400, an exception).
`generate_batch` builds and runs a batch to completion, as the Engine does.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from arborlm.constrained.keys import GrammarError
from arborlm.errors import ContextLengthError, EngineDeadError, InvalidRequestError
from arborlm.runtime.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from arborlm.runtime.tokenizer_manager import TokenizerManager
from arborlm.sampling_params import MAX_N, SamplingParams

# Most requests one call may make (prompts x n), on every entry point, whatever the queue limit:
# each is validated, tokenized and tracked before any runs, so an unbounded call is unbounded
# memory and work for the front. A call of more is refused; send several calls instead.
MAX_REQS_PER_CALL = 1024


def expand_requests(
    prompt: str | list[str] | None,
    input_ids: list[int] | list[list[int]] | None,
    sampling_params: dict | SamplingParams | list | None,
    prompt_param: str = "prompt",
    max_reqs: int | None = MAX_REQS_PER_CALL,
    **kwargs: Any,
) -> tuple[list[GenerateReqInput], bool]:
    """Normalise one request or a batch into single requests, prompt by prompt.

    `n > 1` expands each prompt into n consecutive requests (seeds `seed + i`
    when a seed is given). `kwargs` are further `GenerateReqInput` fields.
    Every `n` and the number of requests (at most `max_reqs`; None: no cap, the
    in-process Engine's offline batches) are checked before any is made.

    Returns
    -------
    (requests, is_batch): `is_batch` is True for a list of prompts or `n > 1`,
    i.e. when the caller answers with a list.

    Raises
    ------
    InvalidRequestError: both or neither of prompt and input_ids, an empty
        batch, a non-string prompt, mismatched `sampling_params`, an `n` that is
        not an integer in [1, `MAX_N`].
    CallTooLargeError: more than `MAX_REQS_PER_CALL` requests (prompts x n).
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
    params_list = _params_per_item(sampling_params, len(items))
    ns = [_checked_n(params.pop("n", 1)) for params in params_list]
    check_fan_out(len(items), sum(ns), prompt_param, max_reqs)
    reqs = []
    for item, params, n in zip(items, params_list, ns):
        for i in range(n):
            p = dict(params)
            if n > 1 and p.get("seed") is not None:
                p["seed"] = p["seed"] + i
            text, ids = (item, None) if prompt is not None else (None, item)
            reqs.append(GenerateReqInput(text=text, input_ids=ids, sampling_params=p, **kwargs))
    return reqs, is_batch or len(reqs) > 1


def _checked_n(n: Any) -> int:
    """One prompt's `n` (`SamplingParams.verify` never sees it: it is taken out here).

    Raises
    ------
    InvalidRequestError: naming ``n``.
    """
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be an integer in [1, {MAX_N}]", param="n")
    return n


def check_fan_out(num_prompts: int, num_reqs: int, prompt_param: str,
                  max_reqs: int | None = MAX_REQS_PER_CALL) -> None:
    """Refuse a call of more than `max_reqs` requests before any is made.

    Parameters
    ----------
    num_prompts: the call's prompts.
    num_reqs: its requests, prompts x n.
    prompt_param: the prompt field, named when there are several prompts (else ``n``).
    max_reqs: the cap; None checks nothing.

    Raises
    ------
    CallTooLargeError
    """
    if max_reqs is not None and num_reqs > max_reqs:
        raise CallTooLargeError(
            f"this call makes {num_reqs} requests (prompts x n), more than the {max_reqs} one call "
            "may make; send fewer per call",
            param=prompt_param if num_prompts > 1 else "n",
        )


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


# A built item: a request to run, or (an Engine batch item whose grammar was refused
# before queueing) its final result already.
BatchItem = TokenizedGenerateReqInput | dict[str, Any]


class DuplicateRequestIdError(InvalidRequestError):
    """Two requests of one call have the same id (`param` is ``rid``)."""


class CallTooLargeError(InvalidRequestError):
    """A call makes more requests than the server ever holds at once (not "busy": it never fits)."""


@dataclass(frozen=True)
class BatchRules:
    """What one entry point checks of a call's requests, beyond every item's own fields.

    Parameters
    ----------
    grammar_fails_alone: a grammar refused before queueing fails only its item
        (its result says why) in a batch of more than one; False: it rejects the call.
    check_context: prompt + an explicit `max_new_tokens` must fit the context;
        without an explicit one generation just stops at the context's end.
    never_fits_param: when set, a call of more requests than the server ever
        holds at once is refused naming this field, instead of reported busy.
    max_reqs_per_call: the most requests one call may make; None: no cap.
    """

    grammar_fails_alone: bool = False
    check_context: bool = False
    never_fits_param: str | None = None
    max_reqs_per_call: int | None = MAX_REQS_PER_CALL


# The in-process Engine (and /health_generate, which runs as it does). Its caller is the
# process's own code, as with SGLang's Engine: an offline batch of any size is one call.
ENGINE_RULES = BatchRules(grammar_fails_alone=True, max_reqs_per_call=None)


async def build_batch(manager: TokenizerManager, reqs: list[GenerateReqInput], rules: BatchRules) -> list[BatchItem]:
    """Validate and tokenize every request of one call before any runs.

    Building runs in a worker thread: preparing a large JSON schema or
    tokenizing a long prompt takes a while, and the event loop keeps answering
    other requests meanwhile.

    Parameters
    ----------
    manager: the front whose queue the requests go to.
    reqs: the call's requests, in order.
    rules: the entry point's checks (`BatchRules`).

    Returns
    -------
    One item per request, in order: a `TokenizedGenerateReqInput`, or with
    `rules.grammar_fails_alone` the final result dict of an item whose grammar
    was refused (no output, the reason in ``finish_reason``).

    Raises
    ------
    DuplicateRequestIdError: two requests share an id.
    CallTooLargeError: more than `MAX_REQS_PER_CALL` requests; with
        `rules.never_fits_param`, also a call that can never fit the queue.
    InvalidRequestError: a malformed item (a `GrammarError` too, unless it fails alone).
    ContextLengthError: with `rules.check_context`, an item does not fit the context.
    ServerOverloadedError: no room in the queue for the call now.
    """
    check_distinct_rids(reqs)
    # A list built by hand, not by expand_requests.
    check_fan_out(len(reqs), len(reqs), rules.never_fits_param or "prompt", rules.max_reqs_per_call)
    if rules.never_fits_param is not None:
        check_possible(manager, len(reqs), rules.never_fits_param)
    grammar_alone = rules.grammar_fails_alone and len(reqs) > 1
    built = await asyncio.to_thread(lambda: [_build_one(manager, r, grammar_alone) for r in reqs])
    if rules.check_context:
        for req, item in zip(reqs, built):
            if not is_refused(item) and _explicit_max_new_tokens(req):
                check_context(len(item.input_ids), item.sampling_params.max_new_tokens,
                              manager.model_info.context_length)
    manager.check_capacity(sum(not is_refused(item) for item in built))
    return built


def check_distinct_rids(reqs: list[GenerateReqInput]) -> None:
    """Refuse a call in which two requests give the same id (ids the front assigns are unique).

    Raises
    ------
    DuplicateRequestIdError
    """
    given = [r.rid for r in reqs if isinstance(r.rid, str)]  # a rid of another type fails its own item
    if len(set(given)) < len(given):
        raise DuplicateRequestIdError("the request ids of one call must be distinct", param="rid")


def check_possible(manager: TokenizerManager, num_reqs: int, param: str) -> None:
    """Refuse `num_reqs` requests of one call that can never be in flight together (busy is a
    `ServerOverloadedError` instead, which a client may retry).

    Raises
    ------
    CallTooLargeError: naming `param`.
    """
    limit = manager.max_in_flight
    if limit is not None and num_reqs > limit:
        raise CallTooLargeError(
            f"this call makes {num_reqs} requests (prompts x n), more than this server ever holds at once: "
            f"{limit} (max_running_requests={manager.model_info.max_running_requests} + "
            f"max_queued_requests={manager.server_args.scheduler.max_queued_requests}); send fewer per call",
            param=param,
        )


def check_context(prompt_len: int, max_new_tokens: int, context_len: int) -> None:
    """Refuse a prompt and `max_new_tokens` that together exceed the context.

    Raises
    ------
    ContextLengthError: naming ``max_new_tokens``.
    """
    if prompt_len + max_new_tokens > context_len:
        raise ContextLengthError(
            f"this model's context is {context_len} tokens, but {prompt_len + max_new_tokens} were requested "
            f"({prompt_len} in the prompt, {max_new_tokens} in max_new_tokens); reduce the prompt or max_new_tokens",
            param="max_new_tokens",
        )


def is_refused(item: BatchItem) -> bool:
    """True for a batch item that is already its (refused) result, not a request to run."""
    return isinstance(item, dict)


def _build_one(manager: TokenizerManager, req: GenerateReqInput, grammar_alone: bool) -> BatchItem:
    """One request built; with `grammar_alone`, a refused grammar becomes that item's result."""
    try:
        return manager.build_request(req)
    except GrammarError as e:
        if not grammar_alone:
            raise
        # build_request checks the grammar last, so the prompt is known to be fine.
        return refused_result(req.rid or uuid.uuid4().hex, len(manager.prompt_ids(req)), e)


def _explicit_max_new_tokens(req: GenerateReqInput) -> bool:
    """Whether the caller set `max_new_tokens` (a sampling dict with the key; an object always has one)."""
    params = req.sampling_params
    return "max_new_tokens" in params if isinstance(params, dict) else params is not None


async def generate_batch(manager: TokenizerManager, reqs: list[GenerateReqInput]) -> list[dict[str, Any]]:
    """Build (`ENGINE_RULES`) and run non-streaming requests together; one final result dict each, in order.

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
    return await run_built_batch(manager, await build_batch(manager, reqs, ENGINE_RULES))


def rejected_result(req: TokenizedGenerateReqInput, error: InvalidRequestError) -> dict[str, Any]:
    """The result of a batch item the scheduler refused: no output, the reason in `finish_reason`."""
    return refused_result(req.rid, len(req.input_ids), error)


def refused_result(rid: str, prompt_tokens: int, error: InvalidRequestError) -> dict[str, Any]:
    """The result of a batch item whose grammar was refused: no output, the reason in `finish_reason`."""
    reason = {"type": "abort", "message": error.message, "param": error.param}
    meta = {"id": rid, "prompt_tokens": prompt_tokens, "completion_tokens": 0, "cached_tokens": 0,
            "finish_reason": reason, "matched_stop": None}
    return {"text": "", "output_ids": [], "meta_info": meta}


async def run_built_batch(manager: TokenizerManager, built: list[BatchItem]) -> list[dict[str, Any]]:
    """Run already-built requests together; one final result dict each, in order.

    An item that is already a result dict (refused before queueing) is returned as is.
    A request refused after queueing (a grammar that did not compile) reports it in
    its own result when the batch has more than one item, and raises when alone.

    Raises
    ------
    InvalidRequestError: a single request refused after queueing.
    EngineDeadError: the scheduler process is gone.
    """

    async def one(req: BatchItem) -> dict[str, Any]:
        if is_refused(req):
            return req
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
