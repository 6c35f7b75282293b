"""The small endpoints SGLang's router, dashboards and client code call, in SGLang's shapes.

- ``POST /tokenize`` (and ``/v1/tokenize``): ``{"prompt": str | [str], "add_special_tokens": true}``
  → ``{"tokens", "count", "max_model_len"}`` (lists for a list of prompts);
- ``POST /detokenize`` (and ``/v1/detokenize``): ``{"tokens": [int] | [[int]], "skip_special_tokens"}``
  → ``{"text"}``;
- ``GET /get_load``: per data-parallel rank (one here) ``{"dp_rank", "num_reqs",
  "num_waiting_reqs", "num_tokens"}``, what the router balances by (`num_tokens`: KV
  slots held by requests);
- ``GET /version``: ``{"version"}``.

(``/server_info`` and ``/model_info``, SGLang's current names of ``/get_server_info`` and
``/get_model_info``, are served beside them in `native_api.py`.)

Tokenizing runs on a worker thread (a long prompt takes a while); token ids
outside the vocabulary are a 400 naming the id's place (``tokens[1][3]``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from arborlm.entrypoints.http_errors import bad_request
from arborlm.entrypoints.openai.common import parse_body
from arborlm.entrypoints.server_state import get_state
from arborlm.version import __version__

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = False


@router.post("/tokenize")
@router.post("/v1/tokenize", operation_id="tokenize_v1")
async def tokenize(request: Request) -> dict[str, Any]:
    """Token ids of one prompt or of each of a list (SGLang's `TokenizeResponse`)."""
    state = get_state(request)
    body = await parse_body(request, TokenizeRequest)
    state.check_model(body.model)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    encode = state.tokenizer.encode
    ids = await asyncio.to_thread(lambda: [encode(p, add_special_tokens=body.add_special_tokens) for p in prompts])
    one = isinstance(body.prompt, str)
    return {"tokens": ids[0] if one else ids, "count": len(ids[0]) if one else [len(t) for t in ids],
            "max_model_len": state.model_info.context_length}


@router.post("/detokenize")
@router.post("/v1/detokenize", operation_id="detokenize_v1")
async def detokenize(request: Request) -> dict[str, Any]:
    """The text of one list of token ids or of each of a list of lists (SGLang's `DetokenizeResponse`).

    Raises
    ------
    APIError: 400 naming the first id outside the vocabulary.
    """
    state = get_state(request)
    body = await parse_body(request, DetokenizeRequest)
    state.check_model(body.model)
    one = not body.tokens or isinstance(body.tokens[0], int)
    seqs: list[list[int]] = [body.tokens] if one else body.tokens  # type: ignore[list-item]
    vocab = state.model_info.vocab_size
    for i, seq in enumerate(seqs):
        for j, token in enumerate(seq):
            if not 0 <= token < vocab:
                where = f"tokens[{j}]" if one else f"tokens[{i}][{j}]"
                raise bad_request(f"{where}: token id {token} is outside the vocabulary [0, {vocab})", where)
    decode = state.tokenizer.decode
    texts = await asyncio.to_thread(lambda: [decode(s, skip_special_tokens=body.skip_special_tokens) for s in seqs])
    return {"text": texts[0] if one else texts}


@router.get("/get_load")
async def get_load(request: Request) -> list[dict[str, Any]]:
    """Load per data-parallel rank, as SGLang's router reads it."""
    info = await get_state(request).live_manager().get_info()
    held = info["max_total_tokens"] - info["free_kv_tokens"] - info["evictable_kv_tokens"]
    return [{"dp_rank": 0, "num_reqs": info["num_running_reqs"] + info["num_waiting_reqs"],
             "num_waiting_reqs": info["num_waiting_reqs"], "num_tokens": held}]


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}
