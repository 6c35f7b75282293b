"""Output constraints in the dialects of other servers (issue 16): vLLM's `guided_*` fields and
its `structured_outputs` object, and OpenAI's json_schema wrapper sent as SGLang's `json_schema`,
were silently ignored (a 200 with free text). Each now maps to arborlm's constraint with vLLM's
meaning, or is a 400 naming the field.

The mapping is checked on its own; then the official `openai` client sends each dialect in
`extra_body` to the folder's shared tiny-model server, and the output must satisfy it.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string

from arborlm.constrained.base import GrammarError, GrammarKey
from arborlm.constrained.registry import GRAMMAR_BACKEND_NAMES, backend_class
from arborlm.entrypoints.http_errors import APIError
from arborlm.entrypoints.openai.common import field_names, openai_error, sampling_params
from arborlm.entrypoints.openai.constraints import choice_regex
from arborlm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from arborlm.errors import InvalidRequestError
from arborlm.sampling_params import SamplingParams
from tests.server.conftest import API_KEY

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
CHOICES = ["red", "a.b", "x|y (z)", "c++", "back\\slash", "[1]{2}^$?", "naïve ☃"]
GRAMMAR = 'root ::= "yes" | "no"'


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def _constraint(**fields) -> dict:
    """The native constraint fields `fields` map to."""
    params = sampling_params(chat(**fields), 5)
    return {k: v for k, v in params.items() if k != "max_new_tokens"}


# ---- the mapping ----------------------------------------------------------------------------


@pytest.mark.parametrize("fields, native, param", [
    ({"guided_json": SCHEMA}, {"json_schema": SCHEMA}, "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, {"json_schema": json.dumps(SCHEMA)}, "guided_json"),
    ({"guided_regex": "[0-9]{3}"}, {"regex": "[0-9]{3}"}, "guided_regex"),
    ({"guided_choice": ["a", "b"]}, {"regex": "(a|b)"}, "guided_choice"),
    ({"guided_grammar": GRAMMAR}, {"ebnf": GRAMMAR}, "guided_grammar"),
    ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": SCHEMA}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a+"}}, {"regex": "a+"}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a"]}}, {"regex": "(a)"}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": GRAMMAR}}, {"ebnf": GRAMMAR}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, {"json_schema": {"type": "object"}},
     "structured_outputs.json_object"),
    ({"structured_outputs": {"structural_tag": "{}"}}, {"structural_tag": "{}"}, "structured_outputs.structural_tag"),
    # options that pick an implementation, not the output
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, {"regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "disable_fallback": True}}, {"regex": "a"}, "structured_outputs.regex"),
])
def test_each_dialect_maps_to_one_native_constraint(fields, native, param):
    assert _constraint(**fields) == native
    names = field_names(chat(**fields))
    assert set(names.values()) == {param}  # errors about the native field name the request's


@pytest.mark.parametrize("fields, param", [
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json"),
    ({"guided_regex": "a", "regex": "b"}, "guided_regex"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_grammar": GRAMMAR, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"json_schema": SCHEMA, "structured_outputs": {"json": SCHEMA}}, "structured_outputs.json"),
])
def test_two_constraints_in_any_dialects_are_refused(fields, param):
    with pytest.raises(APIError) as excinfo:
        sampling_params(chat(**fields), 5)
    assert excinfo.value.status == 400 and excinfo.value.param == param
    assert excinfo.value.message.startswith("give only one of ")


@pytest.mark.parametrize("fields, param", [
    ({"guided_whitespace_pattern": r"[ ]?"}, "guided_whitespace_pattern"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_what_cannot_be_served_is_refused_naming_it(fields, param):
    with pytest.raises(APIError) as excinfo:
        sampling_params(chat(**fields), 5)
    assert excinfo.value.status == 400 and excinfo.value.param == param


def test_an_unknown_structured_outputs_key_is_refused_not_ignored():
    with pytest.raises(Exception) as excinfo:
        CompletionRequest.model_validate_json('{"prompt": "x", "structured_outputs": {"jsonn": {}}}')
    assert excinfo.value.errors()[0]["loc"] == ("structured_outputs", "jsonn")


@pytest.mark.parametrize("backend", GRAMMAR_BACKEND_NAMES)
def test_the_choice_regex_compiles_on_every_backend(backend):
    backend_class(backend).check(GrammarKey("regex", choice_regex(CHOICES, "guided_choice")))


def test_the_choice_regex_matches_exactly_the_choices():
    regex = choice_regex(CHOICES, "guided_choice")
    grammar = Grammar.from_regex(regex)
    for choice in CHOICES:
        assert re.fullmatch(regex, choice) and _is_grammar_accept_string(grammar, choice), choice
    for other in ["re", "redd", "axb", "x", "c+", "back\\\\slash", "[1]{2}", ""]:
        assert not re.fullmatch(regex, other) and not _is_grammar_accept_string(grammar, other), other


def test_errors_about_a_mapped_constraint_name_the_request_field():
    broken = GrammarError("the grammar does not parse", "ebnf")
    assert openai_error(broken, field_names(chat(guided_grammar="start: x"))).param == "guided_grammar"
    schema_error = GrammarError("uniqueItems cannot be enforced. Set json_schema_lenient", "json_schema")
    error = openai_error(schema_error, field_names(chat(structured_outputs={"json": SCHEMA})))
    assert error.param == "structured_outputs.json" and "json_schema_lenient" not in error.message


WRAPPER = {"name": "answer", "strict": True, "schema": SCHEMA}


@pytest.mark.parametrize("value", [WRAPPER, json.dumps(WRAPPER)])
def test_response_formats_wrapper_sent_as_json_schema_is_refused(value):
    """As a schema, {name, schema, strict} constrains nothing: the output was free JSON."""
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(json_schema=value).verify(100)
    assert excinfo.value.param == "json_schema" and "response_format" in excinfo.value.message
    SamplingParams(json_schema={"type": "object", "properties": {"schema": {"type": "object"}}}).verify(100)


# ---- against the server, with the official client ----------------------------------------------------


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _chat(client, extra_body: dict) -> tuple[str, str]:
    out = client.chat.completions.create(model="default", messages=MESSAGES, temperature=0, max_tokens=48,
                                         extra_body=extra_body)
    return out.choices[0].message.content, out.choices[0].finish_reason


def _complete(client, extra_body: dict) -> tuple[str, str]:
    out = client.completions.create(model="default", prompt="Answer:", temperature=0, max_tokens=48,
                                    extra_body=extra_body)
    return out.choices[0].text, out.choices[0].finish_reason


def _valid_json(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


def _json_object_or_its_start(text: str, reason: str) -> bool:
    """The random model writes a free object until max_tokens: a finished one must parse."""
    return isinstance(json.loads(text), dict) if reason == "stop" else text.lstrip().startswith("{")


@pytest.mark.parametrize("extra_body, check", [
    ({"guided_json": SCHEMA}, _valid_json),
    ({"structured_outputs": {"json": SCHEMA}}, _valid_json),
    ({"guided_regex": "[0-9]{3}"}, lambda text: re.fullmatch("[0-9]{3}", text)),
    ({"structured_outputs": {"regex": "(yes|no)!"}}, lambda text: re.fullmatch("(yes|no)!", text)),
    ({"guided_choice": CHOICES}, lambda text: text in CHOICES),
    ({"structured_outputs": {"choice": CHOICES}}, lambda text: text in CHOICES),
    ({"guided_grammar": GRAMMAR}, lambda text: text in ("yes", "no")),
    # Lark (vLLM's guidance dialect): xgrammar refuses it, the default backend auto gives it to llguidance
    ({"guided_grammar": 'start: "yes" | "no"'}, lambda text: text in ("yes", "no")),
    ({"structured_outputs": {"json_object": True}}, None),
], ids=["guided_json", "so.json", "guided_regex", "so.regex", "guided_choice", "so.choice", "guided_grammar",
        "guided_grammar.lark", "so.json_object"])
def test_the_output_satisfies_the_dialects_constraint(client, http, extra_body, check):
    for text, reason in (_chat(client, extra_body), _complete(client, extra_body)):
        if check is None:
            assert _json_object_or_its_start(text, reason), text
        else:
            assert reason == "stop" and check(text), (text, reason)


@pytest.mark.parametrize("extra_body, param", [
    ({"guided_grammar": 'root ::= ("yes"'}, "guided_grammar"),  # unbalanced: neither GBNF nor Lark
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    ({"json_schema": WRAPPER}, "json_schema"),
])
def test_a_constraint_that_cannot_be_served_is_a_400(client, http, extra_body, param):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=4, extra_body=extra_body)
    assert excinfo.value.body["param"] == param
