"""`POST /v1/embeddings` (OpenAI's) and `POST /encode` (SGLang's native name) on an embedding server.

A server started with `--is-embedding` serves an embedding checkpoint: each
input (a string, a list of strings, token ids or lists of token ids) becomes
one prefill-only request (``max_new_tokens`` 0) batched by the scheduler like
any other, whose hidden states the model worker pools (`runtime/embedding.py`,
pooling from the checkpoint's sentence-transformers config:
`runtime/pooling_config.py`). Here the vector is truncated to `dimensions`
(Matryoshka models only) and normalized when the model normalizes, then sent
as floats or, with ``encoding_format: base64``, as the base64 of its
little-endian float32 bytes (what the `openai` client asks for and decodes).
Strings are tokenized with the tokenizer's special tokens (as
sentence-transformers does: a last-token model reads its EOS).

A generation server refuses these routes with a 400 naming `model`: its
model was not trained to embed, and last-token states of a chat model are no
substitute for an embedding model.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import struct
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from arborlm.entrypoints.http_errors import APIError, bad_request
from arborlm.entrypoints.openai.common import abort_message, openai_errors, parse_body, run_all
from arborlm.entrypoints.request_builder import BatchRules, build_batch
from arborlm.entrypoints.server_state import ServerState, get_state
from arborlm.runtime.io_struct import GenerateReqInput
from arborlm.runtime.pooling_config import PoolingConfig, normalized, read_pooling_config

router = APIRouter()
# One call's inputs may not exceed what the server can ever hold at once (`build_batch`).
EMBEDDING_RULES = BatchRules(never_fits_param="input")


class EmbeddingRequest(BaseModel):
    """`POST /v1/embeddings`."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] = Field(...)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EncodeRequest(BaseModel):
    """`POST /encode` (SGLang's): `text` or `input_ids`, one or a batch."""

    model_config = ConfigDict(strict=True, extra="ignore")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None


@functools.lru_cache(maxsize=8)
def _pooling(checkpoint: str) -> PoolingConfig:
    return read_pooling_config(checkpoint)


def embedding_pooling(state: ServerState, param: str) -> PoolingConfig:
    """The served model's pooling.

    Raises
    ------
    APIError: 400 naming `param` on a generation server (no `--is-embedding`).
    """
    if not state.server_args.model.is_embedding:
        raise bad_request("this server serves a generation model; embeddings need an embedding model served "
                          "with --is-embedding", param=param)
    return _pooling(state.model_info.checkpoint)


def refuse_generation(state: ServerState) -> None:
    """Refuse a generation route (chat, responses) on an embedding server before its prompt is
    rendered: an embedding checkpoint often has no chat template, and that 400 would name the wrong
    field.

    Raises
    ------
    APIError: 400 naming `model` on a server started with `--is-embedding`.
    """
    if state.server_args.model.is_embedding:
        raise bad_request("this server serves an embedding model (--is-embedding): it answers "
                          "/v1/embeddings and /encode, not generation", param="model")


@router.post("/v1/embeddings")
async def create_embeddings(request: Request) -> dict[str, Any]:
    """OpenAI's embeddings answer: `data` in input order, `usage` counting the prompt tokens."""
    state = get_state(request)
    req = await parse_body(request, EmbeddingRequest)
    state.check_model(req.model)
    pooling = embedding_pooling(state, "model")
    problem = pooling.check_dimensions(req.dimensions)
    if problem is not None:
        raise bad_request(problem, param="dimensions")
    prompts = await asyncio.to_thread(_prompts, state, req.input, "input")
    results = await _embed(state, prompts)
    data = [{"object": "embedding", "index": i,
             "embedding": _encoded(_finished(r["embedding"], pooling, req.dimensions), req.encoding_format)}
            for i, r in enumerate(results)]
    tokens = sum(len(p) for p in prompts)
    return {"object": "list", "data": data, "model": state.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/encode")
async def encode(request: Request) -> Any:
    """SGLang's `/encode`: `{"embedding", "meta_info"}`, a list for a batch."""
    state = get_state(request)
    body = await parse_body(request, EncodeRequest)
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text and input_ids", param="text")
    param = "text" if body.text is not None else "input_ids"
    pooling = embedding_pooling(state, param)
    given = body.text if body.text is not None else body.input_ids
    prompts = await asyncio.to_thread(_prompts, state, given, param)
    results = await _embed(state, prompts)
    answers = [{"embedding": _finished(r["embedding"], pooling, None), "meta_info": r["meta_info"]}
               for r in results]
    one = isinstance(given, str) or (bool(given) and isinstance(given[0], int))
    return answers[0] if one else answers


def _prompts(state: ServerState, given: Any, param: str) -> list[list[int]]:
    """Token ids of each input.

    Raises
    ------
    APIError: 400 naming `param[i]` for an empty input, `param` for an empty list, and the
        place of a token id outside the vocabulary as /detokenize does (`param[k]` in one
        list of ids, `param[i][k]` in a list of them).
    """
    flat_ids = bool(given) and not isinstance(given, str) and isinstance(given[0], int)
    if isinstance(given, str) or flat_ids:
        given = [given]
    if not given:
        raise bad_request(f"{param} is empty: give a string, a list of strings or token ids", param=param)
    prompts = [state.tokenizer.encode(g) if isinstance(g, str) else list(g) for g in given]
    vocab = state.model_info.vocab_size
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise bad_request(f"{param}[{i}] is empty", param=f"{param}[{i}]")
        if isinstance(given[i], str):
            continue
        for k, token in enumerate(prompt):
            if not 0 <= token < vocab:
                where = f"{param}[{k}]" if flat_ids else f"{param}[{i}][{k}]"
                raise bad_request(f"{where}: token id {token} is outside the vocabulary [0, {vocab})", where)
    return prompts


async def _embed(state: ServerState, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Run one prefill-only request per prompt through the scheduler, together."""
    manager = state.live_manager()
    reqs = [GenerateReqInput(input_ids=p, sampling_params={"max_new_tokens": 0}) for p in prompts]
    with openai_errors({"input_ids": "input"}):
        built = await build_batch(manager, reqs, EMBEDDING_RULES)
        results = await run_all(manager, built)
    for result in results:
        if result.get("embedding") is None:  # aborted (by request, or a failed step) before its prompt was in
            why = abort_message(result["meta_info"]) or "the request ended without an embedding"
            raise APIError(503, why, type="server_error", code="request_aborted")
    return results


def _finished(vector: list[float], pooling: PoolingConfig, dimensions: int | None) -> list[float]:
    """Truncated to `dimensions` (Matryoshka), then normalized when the model normalizes."""
    if dimensions is not None:
        vector = vector[:dimensions]
    return normalized(vector) if pooling.normalize else vector


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")

