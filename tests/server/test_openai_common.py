"""Pure pieces of the OpenAI layer: field mapping, response_format, limits, error params."""

from __future__ import annotations

import pytest

from arborlm.constrained.base import GrammarError
from arborlm.constrained.json_schema import prepare_json_schema
from arborlm.entrypoints.http_errors import APIError, _loc_to_param
from arborlm.entrypoints.openai.common import (
    abort_message,
    field_names,
    max_new_tokens,
    openai_error,
    openai_errors,
    sampling_params,
)
from arborlm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from arborlm.entrypoints.openai.tool_calls import plan_tools

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


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "string"}}},
      "json_schema": {"type": "integer"}}, "json_schema"),  # was: one silently won
    ({"response_format": {"type": "json_object"}, "ebnf": 'root ::= "a"'}, "ebnf"),
    ({"json_schema": {"type": "integer"}, "regex": "a+"}, "regex"),
])
def test_two_constraints_are_refused(fields, param):
    with pytest.raises(APIError) as excinfo:
        sampling_params(chat(**fields), 5)
    assert excinfo.value.status == 400 and excinfo.value.param == param
    assert excinfo.value.message.startswith("give only one of ")
    # response_format "text" is no constraint
    assert sampling_params(chat(response_format={"type": "text"}, regex="a+"), 5)["regex"] == "a+"


UNENFORCEABLE = {"type": "array", "uniqueItems": True}


def _schema_error(schema) -> GrammarError:
    with pytest.raises(GrammarError) as excinfo:
        prepare_json_schema(schema)
    return excinfo.value


def test_schema_errors_name_the_openai_fields():
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": UNENFORCEABLE}}
    error = openai_error(_schema_error(UNENFORCEABLE), field_names(chat(response_format=fmt)))
    assert error.param == "response_format.json_schema.schema"
    assert error.message.startswith("response_format.json_schema.schema uses keywords")
    assert "json_schema_lenient" not in error.message
    assert "Leave response_format.json_schema.strict unset or false" in error.message
    # SGLang's own json_schema field keeps its name; the advice says how to get lenient mode here
    extra = openai_error(_schema_error(UNENFORCEABLE), field_names(chat(json_schema=UNENFORCEABLE)))
    assert extra.param == "json_schema" and "json_schema_lenient" not in extra.message
    with pytest.raises(APIError) as excinfo, openai_errors({"json_schema": "response_format"}):
        raise GrammarError("json_schema is `false`, which accepts no value", "json_schema")
    assert excinfo.value.param == "response_format"


def test_tool_schema_errors_advise_strict_false():
    body = {"messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object", "properties": {"x": UNENFORCEABLE}}}}]}
    with pytest.raises(APIError) as excinfo:
        plan_tools(ChatCompletionRequest.model_validate(body), "xgrammar")
    assert excinfo.value.param == "tools[0].function.parameters"
    assert "json_schema" not in excinfo.value.message and "tools[0].function.strict" in excinfo.value.message


@pytest.mark.parametrize("parameters", [{"type": "string"}, {"type": "array", "items": {}}, {"properties": {}},
                                        {"type": ["object", "null"]}])
def test_tool_parameters_must_describe_an_object(parameters):
    body = {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}
    with pytest.raises(APIError) as excinfo:
        plan_tools(ChatCompletionRequest.model_validate(body), "xgrammar")
    assert excinfo.value.status == 400 and excinfo.value.param == "tools[0].function.parameters"
    assert "object" in excinfo.value.message
    body["tools"][0]["function"]["parameters"] = {}  # no parameters
    assert plan_tools(ChatCompletionRequest.model_validate(body), "xgrammar") is not None


def test_abort_message():
    assert abort_message({"finish_reason": {"type": "length"}}) is None
    assert abort_message({"finish_reason": None}) is None
    why = "the output does not satisfy the requested json_schema: output is not valid JSON"
    assert abort_message({"finish_reason": {"type": "abort", "message": why}}) == why
    assert abort_message({"finish_reason": {"type": "abort"}}) == "the request was aborted"


@pytest.mark.parametrize("model, body", [
    (ChatCompletionRequest, {"messages": MESSAGES, "max_tokens": 0}),
    (ChatCompletionRequest, {"messages": MESSAGES, "max_completion_tokens": 0}),
    (CompletionRequest, {"prompt": "x", "max_tokens": 0}),
])
def test_max_tokens_zero_is_refused(model, body):
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        model.model_validate(body)


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
