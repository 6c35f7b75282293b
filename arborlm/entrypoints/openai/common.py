"""What `/v1/completions` and `/v1/chat/completions` share: the request body,
OpenAI fields → `SamplingParams`, the rules their requests are built by
(`OPENAI_RULES`), the scheduler's results → choices, usage and logprobs in
OpenAI's shapes, and running the requests of one call together.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from arborlm.entrypoints.browser_guard import require_json
from arborlm.entrypoints.http_errors import APIError, bad_request, validation_error
from arborlm.entrypoints.openai.constraints import request_constraint
from arborlm.entrypoints.openai.protocol import SamplingRequest
from arborlm.entrypoints.request_builder import BatchRules
from arborlm.entrypoints.streaming import merge_streams
from arborlm.errors import InvalidRequestError
from arborlm.runtime.io_struct import TokenizedGenerateReqInput
from arborlm.runtime.tokenizer_manager import TokenizerManager

B = TypeVar("B", bound=BaseModel)

# Python's int() and jiter (pydantic's JSON parser) refuse integer literals of more digits
# (jiter: "number out of range"; Python's limit guards against quadratic-time conversion).
_MAX_INT_DIGITS = 4300
_INT_PART = re.compile(r"-?(\d*)")

# SamplingParams names that OpenAI's API spells differently.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "input_ids": "prompt"}
# /v1/completions without max_tokens (or with null) answers 16 tokens, as OpenAI's does.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# The lenient-mode advice of the schema checker, which names the native sampling field.
_LENIENT_ADVICE = "Set json_schema_lenient"
# Request fields copied as they are into SamplingParams when given (the output constraint,
# in any of its dialects, comes from `constraints.request_constraint`).
_SAME_NAME_FIELDS = (
    "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "stop",
    "top_k", "min_p", "repetition_penalty",
    "ignore_eos", "stop_token_ids", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
)
# How both routes build their requests (`request_builder.build_batch`): the context is checked
# before building (`max_new_tokens`, `check_prompt_len`), so only a call that can never fit
# is refused here, naming `n`; a refused grammar rejects the call.
OPENAI_RULES = BatchRules(never_fits_param="n")


async def parse_body(request: Request, model: type[B]) -> B:
    """The JSON body validated as `model`.

    Raises
    ------
    APIError: 415 for a body not declared JSON (`browser_guard.require_json`);
        400 for an empty or malformed body, or a field of the wrong type.
    """
    require_json(request)
    return parse_json_body(await request.body(), model)


def parse_json_body(body: bytes, model: type[B]) -> B:
    """`body` validated as `model`.

    Raises
    ------
    APIError: 400 for an empty or malformed body, or a field of the wrong type; an
        integer literal of more than 4300 digits is named by its field (``prompt[1][0]``).
    """
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors()
        param = _long_number_param(body) if errors and errors[0].get("type") == "json_invalid" else None
        if param is not None:
            raise bad_request(f"{param}: a number of more than {_MAX_INT_DIGITS} digits is out of range",
                              param) from None
        raise validation_error(errors) from None


class _LongNumber:
    """Stands in for a number literal too long to parse, so that its place can be found."""


def _long_number_param(body: bytes) -> str | None:
    """Where the first number literal of more than `_MAX_INT_DIGITS` integer digits is in the
    JSON `body`, as a param (``sampling_params.stop_token_ids[1]``); None when there is none
    (or the body does not parse for another reason)."""
    marker = _LongNumber()

    def parse_number(text: str, convert) -> Any:
        if len(_INT_PART.match(text)[1]) > _MAX_INT_DIGITS:
            return marker
        return convert(text)

    try:
        value = json.loads(body, parse_int=lambda t: parse_number(t, int),
                           parse_float=lambda t: parse_number(t, float))
    except (ValueError, RecursionError):
        return None
    path = _path_to(value, marker)
    return None if path is None else _path_text(path)


def _path_to(value: Any, target: object) -> list[str | int] | None:
    """Keys and indexes from `value` down to the object `target` (depth first), or None."""
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        node, path = stack.pop()
        if node is target:
            return path
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack.extend((child, [*path, key]) for key, child in reversed(list(children)))
    return None


def _path_text(path: list[str | int]) -> str:
    """["prompt", 1, 0] -> "prompt[1][0]"."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
    return out


def openai_param(name: str | None) -> str | None:
    """A `SamplingParams` field name as the OpenAI request spells it."""
    return _OPENAI_NAMES.get(name, name) if name else name


def max_new_tokens(requested: int | None, prompt_len: int, context_len: int, param: str) -> int:
    """Tokens the answer may have: `requested`, or the rest of the context when None.

    Raises
    ------
    APIError: 400 `context_length_exceeded` when prompt + requested exceed the context.
    """
    room = context_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            f"this model's context is {context_len} tokens, but {prompt_len + requested} were requested "
            f"({prompt_len} in the prompt, {requested} in the completion); reduce the prompt or {param}",
            param=param, code="context_length_exceeded",
        )
    return requested


def check_prompt_len(prompt_len: int, context_len: int, param: str) -> None:
    """Raise 400 when the prompt leaves no room for one generated token."""
    if prompt_len == 0:
        raise bad_request("the prompt is empty", param=param)
    if prompt_len >= context_len:
        raise bad_request(
            f"the prompt has {prompt_len} tokens; this model's context is {context_len} tokens "
            "(prompt + at least one generated token)",
            param=param, code="context_length_exceeded",
        )


def sampling_params(req: SamplingRequest, max_tokens: int) -> dict[str, Any]:
    """The request's sampling fields as a `SamplingParams` dict (unset fields keep SGLang's defaults).

    Raises
    ------
    APIError: 400 for two output constraints at once (`response_format`, SGLang's
        `json_schema`, `regex`, `ebnf`, `structural_tag`, vLLM's `guided_*` and
        `structured_outputs`), or one that cannot be served (`constraints.py`).
    """
    params = {name: getattr(req, name) for name in _SAME_NAME_FIELDS if getattr(req, name) is not None}
    params["max_new_tokens"] = max_tokens
    if req.min_tokens is not None:
        params["min_new_tokens"] = req.min_tokens
    constraint = request_constraint(req)
    if constraint is not None:
        params.update(constraint.params)
    return params


def field_names(req: SamplingRequest) -> dict[str, str]:
    """The fields of this request that the runtime's errors name by their native names,
    as the request spells them (`json_schema` is `response_format.json_schema.schema`
    when the schema came in `response_format`, `regex` is `guided_choice` when it came
    from that choice list)."""
    constraint = request_constraint(req)
    return {} if constraint is None else dict(constraint.names)


def openai_error(error: InvalidRequestError, names: dict[str, str] | None = None) -> APIError:
    """A runtime error as a 400 in the OpenAI request's terms: `param` and the message's
    leading field name mapped (`names`, then `max_new_tokens` → `max_tokens` and the like),
    and the lenient-mode advice as the OpenAI request can follow it."""
    param = (names or {}).get(error.param) or openai_param(error.param)
    message = error.message
    if error.param and param != error.param and message.startswith(error.param):
        message = param + message[len(error.param):]
    return bad_request(with_lenient_advice(message, param), param)


def with_lenient_advice(message: str, param: str | None) -> str:
    """`message` with the native `json_schema_lenient` advice replaced by what `param`'s request can set."""
    if _LENIENT_ADVICE not in message:
        return message
    if param == "response_format.json_schema.schema":
        advice = "Leave response_format.json_schema.strict unset or false"
    elif param is not None and param.startswith("tools["):
        advice = f"Leave {param.removesuffix('.parameters')}.strict unset or false"
    else:
        advice = "Send the schema as response_format (json_schema, strict unset or false)"
    return message.replace(_LENIENT_ADVICE, advice)


@contextlib.contextmanager
def openai_errors(names: dict[str, str] | None = None) -> Iterator[None]:
    """Raise the runtime's `InvalidRequestError`s met inside as `openai_error`s."""
    try:
        yield
    except InvalidRequestError as e:
        raise openai_error(e, names) from None


def seeded(params: dict[str, Any], index: int) -> dict[str, Any]:
    """The sampling dict of choice `index`: `seed + index` when a seed is given, so n choices differ."""
    if index and params.get("seed") is not None:
        return {**params, "seed": params["seed"] + index}
    return dict(params)


def choice_rid(rid: str | None, index: int, count: int) -> str | None:
    """The request id of choice `index` of `count` (`rid`, or `rid-index` when several)."""
    if rid is None:
        return None
    return rid if count == 1 else f"{rid}-{index}"


def stream_all(manager: TokenizerManager, built: list[TokenizedGenerateReqInput]
               ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """Run the requests together; (index, result) as results arrive (chunks when streaming)."""
    return merge_streams([manager.generate(b) for b in built])


async def run_all(manager: TokenizerManager, built: list[TokenizedGenerateReqInput]) -> list[dict[str, Any]]:
    """Run non-streaming requests together; their final results in order.

    Raises
    ------
    InvalidRequestError: one was refused by the scheduler (a grammar that did not compile);
        the others are aborted.
    """
    results: list[dict[str, Any]] = [{} for _ in built]
    async for index, result in stream_all(manager, built):
        results[index] = result
    return results


def finish_reason(meta: dict[str, Any]) -> str | None:
    """OpenAI's finish_reason from SGLang's dict: stop, length, or abort."""
    reason = meta.get("finish_reason")
    return None if reason is None else reason["type"]


def abort_message(meta: dict[str, Any]) -> str | None:
    """Why an aborted choice stopped (SGLang's `finish_reason.message`): a finished output
    that failed its JSON schema, an abort by request id, ...; None for other finishes."""
    reason = meta.get("finish_reason")
    if reason is None or reason.get("type") != "abort":
        return None
    return reason.get("message") or "the request was aborted"


@dataclass
class UsageCounter:
    """Token counts of one call: the prompt counted once per prompt, whatever `n`.

    `prompt_tokens_details.cached_tokens` is in the usage only with `report_cached`
    (`--enable-cache-report`; left out otherwise, as SGLang leaves it out): it tells
    a client which prompt prefixes other clients sent.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    report_cached: bool = False

    def add(self, meta: dict[str, Any], first_of_prompt: bool) -> None:
        self.completion_tokens += meta["completion_tokens"]
        if first_of_prompt:
            self.prompt_tokens += meta["prompt_tokens"]
            self.cached_tokens += meta["cached_tokens"]

    def to_dict(self) -> dict[str, Any]:
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.report_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


def new_id(prefix: str, rid: str | None) -> str:
    return f"{prefix}-{rid or uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class TokenText:
    """Token id → its text, as logprob entries show it (decoded alone, cached)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def last_logprobs(meta: dict[str, Any], count: int) -> tuple[list, list]:
    """The logprob triples and top lists of the last `count` tokens (a stream chunk's own)."""
    tokens = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    start = max(0, len(tokens) - count)
    return tokens[start:], tops[start:]


def chat_logprobs(tokens: list, tops: list, token_text: TokenText, top_n: int) -> dict[str, Any]:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(logprob: float, token_id: int) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for i, (logprob, token_id, _) in enumerate(tokens):
        top = tops[i] if i < len(tops) and top_n else []
        content.append({**entry(logprob, token_id),
                        "top_logprobs": [entry(lp, tid) for lp, tid, _ in top[:top_n]]})
    return {"content": content}


def completion_logprobs(tokens: list, tops: list, token_text: TokenText, top_n: int,
                        text_offset: int = 0) -> dict[str, Any]:
    """OpenAI completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for i, (logprob, token_id, _) in enumerate(tokens):
        text = token_text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        top = tops[i] if i < len(tops) else []
        out["top_logprobs"].append({token_text(tid): lp for lp, tid, _ in top[:top_n]} if top_n else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out
