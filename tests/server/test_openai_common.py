"""Pure pieces of the OpenAI layer: field mapping, response_format, limits, error params."""

from __future__ import annotations

import pytest

from arborlm.runtime.server.errors import APIError, _loc_to_param
from arborlm.runtime.server.openai_common import max_new_tokens, sampling_params
from arborlm.runtime.server.protocol import ChatCompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


@pytest.mark.parametrize("fields, expected", [
    ({}, {"max_new_tokens": 5}),
    ({"temperature": 0, "top_k": 3, "min_tokens": 2, "stop": "x"},
     {"max_new_tokens": 5, "temperature": 0, "top_k": 3, "min_new_tokens": 2, "stop": "x"}),
    ({"response_format": {"type": "text"}}, {"max_new_tokens": 5}),
    ({"response_format": {"type": "json_object"}}, {"max_new_tokens": 5, "json_schema": {"type": "object"}}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "string"}}}},
     {"max_new_tokens": 5, "json_schema": {"type": "string"}, "json_schema_lenient": True}),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "a", "strict": True, "schema": {"type": "string"}}}},
     {"max_new_tokens": 5, "json_schema": {"type": "string"}, "json_schema_lenient": False}),
    ({"logit_bias": {"7": -100}}, {"max_new_tokens": 5, "logit_bias": {"7": -100.0}}),
])
def test_sampling_params_mapping(fields, expected):
    assert sampling_params(chat(**fields), 5) == expected


def test_two_constraints_are_refused():
    with pytest.raises(APIError) as excinfo:
        sampling_params(chat(response_format={"type": "json_object"}, regex="a+"), 5)
    assert excinfo.value.status == 400 and excinfo.value.param == "regex"


def test_max_new_tokens_defaults_to_the_rest_of_the_context():
    assert max_new_tokens(None, 100, 1024, "max_tokens") == 924
    assert max_new_tokens(924, 100, 1024, "max_tokens") == 924
    with pytest.raises(APIError) as excinfo:
        max_new_tokens(925, 100, 1024, "max_tokens")
    assert excinfo.value.code == "context_length_exceeded"


@pytest.mark.parametrize("loc, param", [
    (("messages", 0, "role"), "messages[0].role"),
    (("prompt", "list[int]", 1), "prompt[1]"),
    (("stop", "str"), "stop"),
    (("response_format", "function-after[_schema_given(), ResponseFormat]"), "response_format"),
    ((), None),
])
def test_error_locations_become_openai_params(loc, param):
    assert _loc_to_param(list(loc)) == param
