"""Limits on what one call may ask for, the same on every route (issue 16), on fakes (no model):
fan-out (`n`, prompts x n), top logprobs, stop strings and stop token ids; integers with
thousands of digits; tool function names. Each limit is a 400-style error naming the field."""

from __future__ import annotations

import asyncio
import time

import pytest

from arborlm.entrypoints.http_errors import APIError
from arborlm.entrypoints.openai.common import parse_json_body
from arborlm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from arborlm.entrypoints.openai.tool_calls import plan_tools
from arborlm.entrypoints.request_builder import (
    ENGINE_RULES,
    MAX_REQS_PER_CALL,
    CallTooLargeError,
    build_batch,
    expand_requests,
)
from arborlm.errors import InvalidRequestError
from arborlm.runtime.config import ServerArgs
from arborlm.runtime.io_struct import GenerateReqInput, ModelInfo
from arborlm.runtime.scheduler_process import PortArgs
from arborlm.runtime.tokenizer_manager import TokenizerManager
from arborlm.sampling_params import (
    MAX_N,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)
from tests.server.test_request_builder import NATIVE_RULES, OPENAI_RULES, FakeManager

VOCAB = 49152
HUGE = 10**5000  # more digits than Python turns into text (4300): repr() and str() raise
MESSAGES = [{"role": "user", "content": "hi"}]


def _param_of(call) -> str | None:
    with pytest.raises(InvalidRequestError) as excinfo:
        call()
    return excinfo.value.param


# ---- fan-out: n and prompts x n ------------------------------------------------------


@pytest.mark.parametrize("n", [MAX_N + 1, 10**4000])
def test_n_above_the_cap_is_refused_before_expanding(n):
    """`expand_requests` pops n before `verify` sees it: it must check the cap itself, at once
    (a 4000-digit n made the native route loop forever)."""
    started = time.monotonic()
    assert _param_of(lambda: expand_requests("x", None, {"n": n})) == "n"
    assert time.monotonic() - started < 1
    reqs, _ = expand_requests("x", None, {"n": MAX_N})
    assert len(reqs) == MAX_N


@pytest.mark.parametrize("prompts, sampling, param", [
    (["x"] * (MAX_REQS_PER_CALL // 64 + 1), {"n": 64}, "text"),
    (["x"] * (MAX_REQS_PER_CALL + 1), None, "text"),
    (["x", "y"], [{"n": MAX_N}, {"n": MAX_N}], None),  # 256: fits
])
def test_prompts_times_n_is_bounded_without_a_queue_limit(prompts, sampling, param):
    call = lambda: expand_requests(prompts, None, sampling, prompt_param="text")  # noqa: E731
    if param is None:
        assert len(call()[0]) == 2 * MAX_N
    else:
        with pytest.raises(CallTooLargeError) as excinfo:
            call()
        assert excinfo.value.param == param and str(MAX_REQS_PER_CALL) in excinfo.value.message


class UnboundedManager(FakeManager):
    """No --max-queued-requests: the manager sets no limit of its own."""

    max_in_flight = None


@pytest.mark.parametrize("rules", [NATIVE_RULES, OPENAI_RULES], ids=["native", "openai"])
def test_build_batch_bounds_an_http_call_without_a_queue_limit(rules):
    reqs = [GenerateReqInput(text="x", sampling_params={}) for _ in range(MAX_REQS_PER_CALL + 1)]
    with pytest.raises(CallTooLargeError):
        asyncio.run(build_batch(UnboundedManager(), reqs, rules))


def test_the_engine_takes_an_offline_batch_of_any_size():
    """The in-process Engine is its caller's own code (as SGLang's): no per-call cap there."""
    reqs, is_batch = expand_requests(["x"] * (2 * MAX_REQS_PER_CALL), None, {"n": 2}, max_reqs=None)
    assert len(reqs) == 4 * MAX_REQS_PER_CALL and is_batch
    assert ENGINE_RULES.max_reqs_per_call is None


def test_completions_prompts_times_n_is_bounded():
    req = CompletionRequest.model_validate({"prompt": ["x"] * 9, "n": MAX_N})
    from arborlm.entrypoints.openai.serving_completions import check_fan_out

    with pytest.raises(APIError) as excinfo:
        check_fan_out(9, req.n)
    assert excinfo.value.status == 400 and excinfo.value.param == "n"
    check_fan_out(8, MAX_N)


# ---- top logprobs, stop strings, stop token ids ---------------------------------------------


@pytest.mark.parametrize("fields, param", [
    ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": "s" * (MAX_STOP_LEN + 1)}, "stop"),
    ({"stop": ["ok", "s" * (MAX_STOP_LEN + 1)]}, "stop"),
    ({"stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
])
def test_stop_lists_are_bounded(fields, param):
    assert _param_of(lambda: SamplingParams(**fields).verify(VOCAB)) == param


def test_stop_limits_admit_their_maximum():
    SamplingParams(stop=["s" * MAX_STOP_LEN] * MAX_STOP_STRINGS, stop_token_ids=[5] * MAX_STOP_TOKEN_IDS).verify(VOCAB)


MODEL_INFO = ModelInfo(checkpoint="fake", architecture="LlamaForCausalLM", dtype="float32", device="cpu",
                       vocab_size=VOCAB, context_length=64, max_total_tokens=256, max_running_requests=4,
                       eos_token_ids=(2,))


@pytest.fixture
def manager(tmp_path):
    """A real front on IPC sockets with no scheduler behind it: `build_request` only validates."""
    port_args = PortArgs(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    front = TokenizerManager(ServerArgs.from_kwargs(), MODEL_INFO, None, port_args)
    yield front
    front.close()


@pytest.mark.parametrize("top", [MAX_TOP_LOGPROBS + 1, VOCAB, 10**4000])
def test_top_logprobs_num_is_bounded_as_openai_and_vllm_bound_it(manager, top):
    req = GenerateReqInput(input_ids=[1, 2], return_logprob=True, top_logprobs_num=top)
    assert _param_of(lambda: manager.build_request(req)) == "top_logprobs_num"
    ok = GenerateReqInput(input_ids=[1, 2], return_logprob=True, top_logprobs_num=MAX_TOP_LOGPROBS)
    assert manager.build_request(ok).top_logprobs_num == MAX_TOP_LOGPROBS


# ---- integers with thousands of digits ---------------------------------------------------------


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),  # int(key) raised ValueError: a 500
    ({"logit_bias": {5: 10**400}}, "logit_bias"),  # math.isnan(10**400) raised OverflowError
    ({"temperature": 10**400}, "temperature"),
    ({"max_new_tokens": HUGE}, "max_new_tokens"),  # min_new_tokens went into an int64 tensor
    ({"max_new_tokens": -HUGE}, "max_new_tokens"),  # the message's repr() raised ValueError
    ({"max_new_tokens": 2**70, "min_new_tokens": 2**69}, "max_new_tokens"),
    ({"top_k": 2**64}, "top_k"),
    ({"seed": HUGE}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"stop_token_ids": [HUGE]}, "stop_token_ids"),
    ({"n": HUGE}, "n"),
])
def test_huge_integers_are_invalid_requests(fields, param):
    assert _param_of(lambda: SamplingParams(**fields).verify(VOCAB)) == param


def test_huge_token_ids_are_invalid_requests(manager):
    assert _param_of(lambda: manager.build_request(GenerateReqInput(input_ids=[1, HUGE]))) == "input_ids"
    start = GenerateReqInput(input_ids=[1, 2], return_logprob=True, logprob_start_len=HUGE)
    assert _param_of(lambda: manager.build_request(start)) == "logprob_start_len"


DIGITS = "9" * 5000


@pytest.mark.parametrize("model, body, param", [
    (CompletionRequest, '{"prompt": "x", "max_tokens": ' + DIGITS + '}', "max_tokens"),
    (CompletionRequest, '{"prompt": [[1, 2], [3, ' + DIGITS + ']]}', "prompt[1][1]"),
    (CompletionRequest, '{"prompt": "x", "seed": -' + DIGITS + '}', "seed"),
    (ChatCompletionRequest, '{"messages": [{"role": "user", "content": "x"}], "n": ' + DIGITS + '}', "n"),
    (GenerateRequest, '{"input_ids": [' + DIGITS + ']}', "input_ids[0]"),
    (GenerateRequest, '{"text": "x", "sampling_params": {"stop_token_ids": [1, ' + DIGITS + ']}}',
     "sampling_params.stop_token_ids[1]"),
])
def test_an_integer_literal_too_long_to_parse_names_its_field(model, body, param):
    """jiter refuses integers of more than 4300 digits as "number out of range"; the 400 names where."""
    with pytest.raises(APIError) as excinfo:
        parse_json_body(body.encode(), model)
    assert excinfo.value.status == 400 and excinfo.value.param == param
    assert len(excinfo.value.message) < 300


def test_other_broken_json_still_names_no_field():
    with pytest.raises(APIError) as excinfo:
        parse_json_body(b'{"prompt": ', CompletionRequest)
    assert excinfo.value.status == 400 and excinfo.value.param is None


# ---- tool function names --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["get_weather\n", "a" * 65, "", "get weather", "naïve"])
def test_tool_names_must_match_the_whole_pattern(name):
    """`^...$` with re.match let a trailing newline through (`$` matches before it)."""
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": name}}]})
    with pytest.raises(APIError) as excinfo:
        plan_tools(req, "xgrammar")
    assert excinfo.value.param == "tools[0].function.name"


def test_a_prompt_that_fills_the_context_is_a_context_length_error(manager):
    """/generate answers it as every other context error: OpenAI's 400 `context_length_exceeded`
    (its code was null where the prompt alone filled the context)."""
    from arborlm.entrypoints import native_api
    from arborlm.errors import ContextLengthError

    full = GenerateReqInput(input_ids=[1] * MODEL_INFO.context_length)
    with pytest.raises(ContextLengthError) as excinfo:
        manager.build_request(full)
    assert excinfo.value.param == "input_ids" and excinfo.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as api:
        asyncio.run(native_api._build(manager, [full], NATIVE_RULES))
    assert (api.value.status, api.value.code) == (400, "context_length_exceeded")
    assert manager.build_request(GenerateReqInput(input_ids=[1] * (MODEL_INFO.context_length - 1)))
