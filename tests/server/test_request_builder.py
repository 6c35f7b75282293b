"""`request_builder.build_batch`, the one path by which the Engine, the native routes and the
OpenAI routes build a call's requests, on a fake manager (no model, no scheduler): what each
entry point's `BatchRules` checks, and the error shape each route gives the same failure."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from arborlm.constrained.base import GrammarError
from arborlm.entrypoints import native_api
from arborlm.entrypoints.http_errors import APIError, to_api_error
from arborlm.entrypoints.openai.common import OPENAI_RULES, openai_errors
from arborlm.entrypoints.request_builder import (
    ENGINE_RULES,
    BatchRules,
    CallTooLargeError,
    ContextLengthError,
    DuplicateRequestIdError,
    build_batch,
    generate_batch,
    is_refused,
)
from arborlm.errors import InvalidRequestError, ServerOverloadedError
from arborlm.runtime.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from arborlm.sampling_params import SamplingParams

NATIVE_RULES = BatchRules(check_context=True, never_fits_param="n")
ALL_RULES = pytest.mark.parametrize("rules", [ENGINE_RULES, NATIVE_RULES, OPENAI_RULES],
                                    ids=["engine", "native", "openai"])
CONTEXT_LEN = 64


class FakeManager:
    """The part of `TokenizerManager` that building uses: one token per character, the text
    "bad-grammar" refused as a grammar would be, `in_flight` requests already running."""

    model_info = SimpleNamespace(max_running_requests=2, context_length=CONTEXT_LEN)
    server_args = SimpleNamespace(scheduler=SimpleNamespace(max_queued_requests=2))
    max_in_flight = 4

    def __init__(self, in_flight: int = 0, delay_s: float = 0.0):
        self.in_flight = in_flight
        self.delay_s = delay_s
        self.threads: list[int] = []

    def prompt_ids(self, req: GenerateReqInput) -> list[int]:
        if not req.text:
            raise InvalidRequestError("the prompt is empty", param="text")
        return [1] * len(req.text)

    def build_request(self, req: GenerateReqInput) -> TokenizedGenerateReqInput:
        self.threads.append(threading.get_ident())
        time.sleep(self.delay_s)
        input_ids = self.prompt_ids(req)
        if req.text == "bad-grammar":
            raise GrammarError("regex does not compile", param="regex")
        params = SamplingParams.from_dict(dict(req.sampling_params or {}))
        return TokenizedGenerateReqInput(rid=req.rid or f"gen-{id(req)}", input_ids=input_ids,
                                         sampling_params=params, seed=0)

    def check_capacity(self, num_new: int) -> None:
        if self.in_flight + num_new > self.max_in_flight:
            raise ServerOverloadedError("the server is at capacity; retry later")


def reqs_of(*texts: str, rids: list[str] | None = None, **params) -> list[GenerateReqInput]:
    rids = rids or [None] * len(texts)
    return [GenerateReqInput(text=t, rid=r, sampling_params=dict(params)) for t, r in zip(texts, rids)]


def build(manager: FakeManager, reqs: list[GenerateReqInput], rules: BatchRules) -> list:
    return asyncio.run(build_batch(manager, reqs, rules))


@ALL_RULES
def test_duplicate_rids_are_one_error_for_every_entry_point(rules):
    manager = FakeManager()
    with pytest.raises(DuplicateRequestIdError) as excinfo:
        build(manager, reqs_of("a", "b", rids=["x", "x"]), rules)
    assert excinfo.value.param == "rid"
    assert manager.threads == []  # refused before any item is built
    assert [b.rid for b in build(manager, reqs_of("a", "b", rids=["x", "y"]), rules)] == ["x", "y"]


@ALL_RULES
def test_a_malformed_item_rejects_the_call(rules):
    with pytest.raises(InvalidRequestError) as excinfo:
        build(FakeManager(), reqs_of("a", ""), rules)
    assert excinfo.value.param == "text"


@pytest.mark.parametrize("rules, fails_alone", [(ENGINE_RULES, True), (NATIVE_RULES, False), (OPENAI_RULES, False)],
                         ids=["engine", "native", "openai"])
def test_a_refused_grammar_fails_alone_only_in_an_engine_batch(rules, fails_alone):
    manager = FakeManager(in_flight=3)  # room for one request: the refused item takes none
    if not fails_alone:
        with pytest.raises(GrammarError):
            build(manager, reqs_of("ok", "bad-grammar"), rules)
        return
    ok, refused = build(manager, reqs_of("ok", "bad-grammar", rids=["a", "b"]), rules)
    assert not is_refused(ok) and is_refused(refused)
    reason = refused["meta_info"]["finish_reason"]
    assert reason == {"type": "abort", "message": "regex does not compile", "param": "regex"}
    assert refused["meta_info"]["id"] == "b" and refused["meta_info"]["prompt_tokens"] == len("bad-grammar")
    with pytest.raises(GrammarError):  # alone, it raises
        build(manager, reqs_of("bad-grammar"), rules)


@pytest.mark.parametrize("rules, refused", [(ENGINE_RULES, False), (NATIVE_RULES, True), (OPENAI_RULES, True)],
                         ids=["engine", "native", "openai"])
def test_a_call_that_never_fits_is_refused_not_busy(rules, refused):
    manager = FakeManager()
    if refused:
        with pytest.raises(CallTooLargeError) as excinfo:
            build(manager, reqs_of(*"abcde"), rules)
        assert excinfo.value.param == "n" and "4 (max_running_requests=2 + max_queued_requests=2)" in excinfo.value.message
        assert manager.threads == []
    else:
        with pytest.raises(ServerOverloadedError):
            build(manager, reqs_of(*"abcde"), rules)
    assert len(build(manager, reqs_of(*"abcd"), rules)) == 4


@ALL_RULES
def test_no_room_now_is_busy(rules):
    with pytest.raises(ServerOverloadedError):
        build(FakeManager(in_flight=3), reqs_of("a", "b"), rules)


@pytest.mark.parametrize("params, refused", [
    ({"max_new_tokens": CONTEXT_LEN - 10}, False),
    ({"max_new_tokens": CONTEXT_LEN - 9}, True),
    ({}, False),  # without an explicit max_new_tokens generation stops at the context's end
])
def test_the_context_is_checked_where_the_rules_ask(params, refused):
    reqs = reqs_of("x" * 10, **params)
    for rules in (ENGINE_RULES, OPENAI_RULES):
        build(FakeManager(), reqs, rules)
    if not refused:
        build(FakeManager(), reqs, NATIVE_RULES)
        return
    with pytest.raises(ContextLengthError) as excinfo:
        build(FakeManager(), reqs, NATIVE_RULES)
    assert excinfo.value.param == "max_new_tokens" and f"context is {CONTEXT_LEN} tokens" in excinfo.value.message


def test_each_route_gives_the_errors_its_own_shape():
    # native: the context as OpenAI's 400 context_length_exceeded; the others as a plain 400 / 503
    with pytest.raises(APIError) as excinfo:
        asyncio.run(native_api._build(FakeManager(), reqs_of("x" * 10, max_new_tokens=CONTEXT_LEN), NATIVE_RULES))
    assert (excinfo.value.status, excinfo.value.param, excinfo.value.code) == (400, "max_new_tokens",
                                                                             "context_length_exceeded")
    error = to_api_error(DuplicateRequestIdError("the request ids of one call must be distinct", param="rid"))
    assert (error.status, error.param, error.code) == (400, "rid", None)
    # OpenAI: the same errors, in the request's terms
    with pytest.raises(APIError) as excinfo, openai_errors():
        build(FakeManager(), reqs_of(*"abcde"), OPENAI_RULES)
    assert (excinfo.value.status, excinfo.value.param, excinfo.value.code) == (400, "n", None)


@ALL_RULES
def test_requests_are_built_off_the_event_loop(rules):
    manager = FakeManager(delay_s=0.3)  # as a large JSON schema is prepared

    async def run() -> int:
        ticks = 0

        async def tick() -> None:  # stands for other requests, /health, streams
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        built = await build_batch(manager, reqs_of("a", "b", rids=["a", "b"]), rules)
        ticker.cancel()
        assert [b.rid for b in built] == ["a", "b"]
        assert threading.get_ident() not in manager.threads
        return ticks

    assert asyncio.run(run()) >= 20  # the loop kept running for the 0.6 s of building


def test_generate_batch_returns_a_refused_item_without_running_it():
    class Runs(FakeManager):
        async def generate(self, req):
            yield {"text": "out", "output_ids": [1], "meta_info": {"id": req.rid}}

    results = asyncio.run(generate_batch(Runs(), reqs_of("ok", "bad-grammar", rids=["a", "b"])))
    assert results[0]["text"] == "out" and results[1]["meta_info"]["finish_reason"]["type"] == "abort"
