"""The malformed requests of the bad-input battery, one `Case` each, grouped by what is wrong.

A body is a dict (sent as JSON), raw text or bytes (sent as they are: broken JSON, raw `NaN`,
invalid UTF-8), or a callable returning an iterator of bytes (sent chunked, without a
Content-Length). Each case names the status it must get and, where one field is at fault,
the `param` the error must name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tests.reliability.conftest import MAIN_QUEUE, MAIN_RUNNING, MAX_REQUEST_BYTES

MESSAGES = [{"role": "user", "content": "Name a colour."}]
ONE = {"max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MAX_IN_FLIGHT = MAIN_RUNNING + MAIN_QUEUE


@dataclass(frozen=True)
class Case:
    """One malformed request and the answer it must get."""

    name: str
    path: str
    body: Any = None
    status: int = 400
    param: str | None = None
    method: str = "POST"

    def content(self) -> bytes | Iterator[bytes] | None:
        if self.body is None:
            return None
        if callable(self.body):
            return self.body()
        if isinstance(self.body, bytes):
            return self.body
        if isinstance(self.body, str):
            return self.body.encode("utf-8", "surrogatepass")
        return json.dumps(self.body).encode()


def _nested_schema(depth: int) -> str:
    """A JSON schema nested `depth` arrays deep, as text (json.dumps recurses)."""
    return '{"type":"array","items":' * depth + '{"type":"string"}' + "}" * depth


def _chunked_oversize() -> Iterator[bytes]:
    yield b'{"text": "'
    for _ in range(MAX_REQUEST_BYTES // 65536 + 2):
        yield b"a" * 65536
    yield b'"}'


_OVERSIZE = b'{"prompt": "' + b"a" * (MAX_REQUEST_BYTES + 1024) + b'"}'
_HUGE_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 3} for i in range(20000)},
                "required": [f"p{i}" for i in range(20000)]}
_LONG_TEXT = "word " * 3000  # ~3000 tokens; the tiny model's context is 1024
# An integer literal of more digits than JSON parsers (jiter, Python's int) turn into a number.
_DIGITS = "9" * 5000
# More prompts x n than one call may make (request_builder.MAX_REQS_PER_CALL = 1024), at n = 128.
_FAN_OUT_PROMPTS = ["x"] * 9
_WRAPPER = {"name": "answer", "strict": True, "schema": {"type": "object"}}

CASES: list[Case] = [
    # ---- not JSON, or not an object -------------------------------------------------------
    Case("broken json", "/generate", "{\"text\": "),
    Case("json array body", "/v1/chat/completions", "[1, 2]"),
    Case("json null body", "/v1/completions", "null"),
    Case("json string body", "/generate", '"hello"'),
    Case("empty body", "/v1/chat/completions", b""),
    Case("invalid utf-8 in a string", "/generate", b'{"text": "\xff\xfe\xfd"}'),
    Case("invalid utf-8 body", "/v1/completions", b"\xc3\x28\xa0\xa1"),
    Case("lone surrogate escape", "/generate", '{"text": "\\ud800"}'),
    Case("lone low surrogate in chat", "/v1/chat/completions",
         '{"messages": [{"role": "user", "content": "a\\udfffb"}]}'),
    Case("raw lone surrogate bytes", "/v1/completions", '{"prompt": "\ud800"}'),
    Case("deeply nested body", "/generate", "[" * 50000 + "]" * 50000),
    # ---- missing, unknown and wrongly typed fields ----------------------------------------------
    Case("generate without prompt", "/generate", {"sampling_params": {"max_new_tokens": 1}}, param="text"),
    Case("generate unknown field", "/generate", {"text": "x", "temprature": 0.5}, param="temprature"),
    Case("generate text and input_ids", "/generate", {"text": "x", "input_ids": [1, 2]}, param="text"),
    Case("generate text is a number", "/generate", {"text": 42}, param="text"),
    Case("generate sampling_params a string", "/generate", {"text": "x", "sampling_params": "greedy"},
         param="sampling_params"),
    Case("generate unknown sampling field", "/generate", {"text": "x", "sampling_params": {"beam_width": 4}},
         param="beam_width"),
    Case("generate stream a string", "/generate", {"text": "x", "stream": "yes"}, param="stream"),
    Case("generate rid a number", "/generate", {"text": "x", "rid": 7}, param="rid"),
    Case("generate rids not matching the batch", "/generate", {"text": ["a", "b"], "rid": ["r1"]}, param="rid"),
    Case("generate input_ids with a string", "/generate", {"input_ids": [[1, "two"]]}, param="input_ids[0]"),
    Case("chat without messages", "/v1/chat/completions", {"model": "default"}, param="messages"),
    Case("chat messages null", "/v1/chat/completions", {"messages": None}, param="messages"),
    Case("chat message a string", "/v1/chat/completions", {"messages": ["hi"]}, param="messages[0]"),
    Case("chat content a number", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
         param="messages[0].content"),
    Case("chat message without role", "/v1/chat/completions", {"messages": [{"content": "x"}]},
         param="messages[0].role"),
    Case("chat model a number", "/v1/chat/completions", {"messages": MESSAGES, "model": 5}, param="model"),
    Case("chat max_tokens a string", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": "10"},
         param="max_tokens"),
    Case("chat stream_options wrong type", "/v1/chat/completions",
         {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": "yes"}},
         param="stream_options.include_usage"),
    Case("completions without prompt", "/v1/completions", {"max_tokens": 3}, param="prompt"),
    Case("completions prompt an object", "/v1/completions", {"prompt": {"text": "x"}}, param="prompt"),
    Case("completions mixed prompt list", "/v1/completions", {"prompt": [[1, 2], "a"]}, param="prompt"),
    Case("completions best_of", "/v1/completions", {"prompt": "x", "best_of": 3}, param="best_of"),
    # ---- negative, huge and non-finite numbers --------------------------------------------------
    Case("raw NaN temperature", "/v1/chat/completions",
         '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', param="temperature"),
    Case("raw NaN top_p", "/generate", '{"text": "x", "sampling_params": {"top_p": NaN}}', param="top_p"),
    Case("raw Infinity temperature", "/generate", '{"text": "x", "sampling_params": {"temperature": Infinity}}',
         param="temperature"),
    Case("raw NaN logit bias", "/v1/chat/completions",
         '{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": NaN}}', param="logit_bias"),
    Case("raw -Infinity presence_penalty", "/v1/completions", '{"prompt": "x", "presence_penalty": -Infinity}',
         param="presence_penalty"),
    Case("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -3}, param="max_tokens"),
    Case("negative max_new_tokens", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}},
         param="max_new_tokens"),
    Case("huge max_tokens", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2**64},
         param="max_tokens"),
    Case("huge max_new_tokens", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 10**30}},
         param="max_new_tokens"),
    Case("float max_new_tokens", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1e30}},
         param="max_new_tokens"),
    Case("negative temperature", "/v1/chat/completions", {"messages": MESSAGES, "temperature": -0.5},
         param="temperature"),
    Case("top_p above one", "/v1/completions", {"prompt": "x", "top_p": 1.5}, param="top_p"),
    Case("temperature past float32", "/v1/chat/completions",
         {"messages": MESSAGES, "temperature": 3.5e38, "response_format": {"type": "json_object"}},
         param="temperature"),
    Case("huge top_logprobs_num", "/generate", {"text": "x", "top_logprobs_num": 10**12}, param="top_logprobs_num"),
    Case("negative logprob_start_len", "/generate", {"text": "x", "logprob_start_len": -5},
         param="logprob_start_len"),
    Case("huge stop token id", "/generate", {"text": "x", "sampling_params": {"stop_token_ids": [10**20]}},
         param="stop_token_ids"),
    Case("logit_bias out of range", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 1000}},
         param="logit_bias"),
    Case("token id outside the vocabulary", "/v1/completions", {"prompt": [-1, 5]}, param="prompt"),
    Case("completions logprobs above 20", "/v1/completions", {"prompt": "x", "logprobs": 50}, param="logprobs"),
    Case("top_logprobs_num above 20", "/generate", {"text": "x", "top_logprobs_num": 21}, param="top_logprobs_num"),
    Case("chat top_logprobs above 20", "/v1/chat/completions",
         {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, param="top_logprobs"),
    # ---- stop lists ------------------------------------------------------------------------------
    Case("17 stop strings", "/v1/chat/completions", {"messages": MESSAGES, "stop": [f"s{i}" for i in range(17)]},
         param="stop"),
    Case("a stop string of 257 characters", "/v1/completions", {"prompt": "x", "stop": "s" * 257}, param="stop"),
    Case("generate 17 stop strings", "/generate",
         {"text": "x", "sampling_params": {"stop": [f"s{i}" for i in range(17)]}}, param="stop"),
    Case("257 stop token ids", "/generate", {"text": "x", "sampling_params": {"stop_token_ids": [5] * 257}},
         param="stop_token_ids"),
    # ---- integers with thousands of digits --------------------------------------------------------------
    Case("5000-digit max_tokens literal", "/v1/completions", '{"prompt": "x", "max_tokens": ' + _DIGITS + '}',
         param="max_tokens"),
    Case("5000-digit token id in a prompt", "/v1/completions", '{"prompt": [1, ' + _DIGITS + ']}', param="prompt[1]"),
    Case("5000-digit input id", "/generate", '{"input_ids": [[1], [' + _DIGITS + ']]}', param="input_ids[1][0]"),
    Case("5000-digit seed literal", "/v1/chat/completions",
         '{"messages": [{"role": "user", "content": "x"}], "seed": -' + _DIGITS + '}', param="seed"),
    Case("5000-digit n in sampling_params", "/generate", '{"text": "x", "sampling_params": {"n": ' + _DIGITS + '}}',
         param="sampling_params.n"),
    Case("5000-digit logit_bias key", "/v1/completions", {"prompt": "x", "logit_bias": {_DIGITS: 1}},
         param="logit_bias"),
    Case("generate 5000-digit logit_bias key", "/generate",
         {"text": "x", "sampling_params": {"logit_bias": {_DIGITS: 1}}}, param="logit_bias"),
    Case("generate 400-digit temperature", "/generate", {"text": "x", "sampling_params": {"temperature": 10**400}},
         param="temperature"),
    Case("generate seed beyond int64", "/generate", {"text": "x", "sampling_params": {"seed": 2**64}}, param="seed"),
    Case("chat seed beyond int64", "/v1/chat/completions", {"messages": MESSAGES, "seed": 2**64}, param="seed"),
    Case("generate 4000-digit max_new_tokens", "/generate",
         {"text": "x", "sampling_params": {"max_new_tokens": 10**4000}}, param="max_new_tokens"),
    # ---- empty and over-long prompts ----------------------------------------------------------------
    Case("empty text", "/generate", {"text": ""}, param="text"),
    Case("empty input_ids", "/generate", {"input_ids": []}, param="input_ids"),
    Case("empty completions prompt", "/v1/completions", {"prompt": ""}, param="prompt"),
    Case("empty token list prompt", "/v1/completions", {"prompt": [[]]}, param="prompt"),
    Case("over-long text", "/generate", {"text": _LONG_TEXT}, param="text"),
    Case("over-long completions prompt", "/v1/completions", {"prompt": _LONG_TEXT}, param="prompt"),
    Case("over-long chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": _LONG_TEXT}]},
         param="messages"),
    Case("prompt plus max_tokens over the context", "/v1/completions",
         {"prompt": [5] * 1000, "max_tokens": 100}, param="max_tokens"),
    # ---- messages ----------------------------------------------------------------------------------
    Case("empty messages", "/v1/chat/completions", {"messages": []}, param="messages"),
    Case("unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]},
         param="messages[0].role"),
    Case("image content part", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         param="messages[0].content[0].type"),
    Case("tool call arguments not JSON", "/v1/chat/completions",
         {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]},
         param="messages[0].tool_calls[0].function.arguments"),
    # ---- n and batch size --------------------------------------------------------------------------
    Case("n zero", "/v1/chat/completions", {"messages": MESSAGES, "n": 0}, param="n"),
    Case("n above the maximum", "/v1/chat/completions", {"messages": MESSAGES, "n": 129}, param="n"),
    Case("n huge", "/v1/completions", {"prompt": "x", "n": 10**20}, param="n"),
    Case("generate n above the maximum", "/generate", {"text": "x", "sampling_params": {"n": 129}}, param="n"),
    Case("generate n of 4000 digits", "/generate", {"text": "x", "sampling_params": {"n": 10**4000}}, param="n"),
    Case("generate prompts x n above the per-call limit", "/generate",
         {"text": _FAN_OUT_PROMPTS, "sampling_params": {"n": 128, "max_new_tokens": 1}}, param="text"),
    Case("completions prompts x n above the per-call limit", "/v1/completions",
         {"prompt": _FAN_OUT_PROMPTS, "n": 128, **ONE}, param="n"),
    Case("n above what the server holds", "/v1/completions",
         {"prompt": ["a", "b", "c"], "n": MAX_IN_FLIGHT // 3 + 1, **ONE}, param="n"),
    Case("batch above what the server holds", "/generate",
         {"text": ["x"] * (MAX_IN_FLIGHT + 1), "sampling_params": {"max_new_tokens": 1}}, param="text"),
    # ---- grammars -----------------------------------------------------------------------------------
    Case("schema text not JSON", "/generate", {"text": "x", "sampling_params": {"json_schema": "{bad"}},
         param="json_schema"),
    Case("schema with unknown type", "/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         param="response_format.json_schema.schema"),
    Case("schema with a dangling $ref", "/generate",
         {"text": "x", "sampling_params": {"json_schema": {"$ref": "#/$defs/missing"}}}, param="json_schema"),
    Case("schema properties a number", "/generate",
         {"text": "x", "sampling_params": {"json_schema": {"type": "object", "properties": 5}}}, param="json_schema"),
    Case("schema nested 300 deep", "/generate",
         '{"text": "x", "sampling_params": {"json_schema": ' + _nested_schema(300) + "}}"),
    Case("enormous schema (20000 required properties)", "/generate",
         {"text": "x", "sampling_params": {"json_schema": _HUGE_SCHEMA, "max_new_tokens": 4}}, param="json_schema"),
    Case("response_format json_schema without schema", "/v1/chat/completions",
         {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, param="response_format"),
    Case("response_format unknown type", "/v1/chat/completions",
         {"messages": MESSAGES, "response_format": {"type": "yaml"}}, param="response_format.type"),
    Case("two constraints", "/v1/completions", {"prompt": "x", "regex": "a+", "ebnf": "root ::= \"a\""},
         param="ebnf"),
    Case("regex does not parse", "/generate", {"text": "x", "sampling_params": {"regex": "(a+"}}, param="regex"),
    Case("regex a number", "/generate", {"text": "x", "sampling_params": {"regex": 5}}, param="regex"),
    Case("grammar that never ends", "/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= root"}},
         param="ebnf"),
    # unbalanced: neither xgrammar's GBNF nor llguidance's (`root ::= ` is the empty string to llguidance)
    Case("ebnf does not parse", "/v1/completions", {"prompt": "x", "ebnf": 'root ::= ("a"'}, param="ebnf"),
    Case("bad structural tag", "/generate", {"text": "x", "sampling_params": {"structural_tag": {"bogus": 1}}},
         param="structural_tag"),
    Case("json_schema given as response_format's wrapper", "/v1/chat/completions",
         {"messages": MESSAGES, "json_schema": _WRAPPER}, param="json_schema"),
    Case("generate json_schema given as the wrapper", "/generate",
         {"text": "x", "sampling_params": {"json_schema": _WRAPPER}}, param="json_schema"),
    # ---- other servers' constraint fields ----------------------------------------------------------------
    # Lark is served on the default backend (auto gives it to llguidance); this one does not parse
    Case("guided_grammar in broken Lark", "/v1/chat/completions",
         {"messages": MESSAGES, "guided_grammar": 'start: ("a" | "b"'}, param="guided_grammar"),
    Case("guided_regex does not parse", "/v1/completions", {"prompt": "x", "guided_regex": "(a+"},
         param="guided_regex"),
    Case("guided_choice empty", "/v1/completions", {"prompt": "x", "guided_choice": []}, param="guided_choice"),
    Case("guided_choice not strings", "/v1/chat/completions", {"messages": MESSAGES, "guided_choice": [1, 2]},
         param="guided_choice[0]"),
    Case("guided_json and response_format", "/v1/chat/completions",
         {"messages": MESSAGES, "guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
         param="guided_json"),
    Case("guided_whitespace_pattern", "/v1/completions",
         {"prompt": "x", "guided_json": {"type": "object"}, "guided_whitespace_pattern": "[ ]?"},
         param="guided_whitespace_pattern"),
    Case("structured_outputs without a constraint", "/v1/completions", {"prompt": "x", "structured_outputs": {}},
         param="structured_outputs"),
    Case("structured_outputs unknown key", "/v1/chat/completions",
         {"messages": MESSAGES, "structured_outputs": {"jsonn": {}}}, param="structured_outputs.jsonn"),
    Case("structured_outputs two constraints", "/v1/completions",
         {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, param="structured_outputs.choice"),
    Case("structured_outputs disable_any_whitespace", "/v1/chat/completions",
         {"messages": MESSAGES, "structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
         param="structured_outputs.disable_any_whitespace"),
    Case("generate guided_json in sampling_params", "/generate",
         {"text": "x", "sampling_params": {"guided_json": {"type": "object"}}}, param="guided_json"),
    # ---- tools --------------------------------------------------------------------------------------
    Case("tool_choice unknown word", "/v1/chat/completions",
         {"messages": MESSAGES, "tools": [TOOL], "tool_choice": "sometimes"}, param="tool_choice"),
    Case("tool_choice names a missing tool", "/v1/chat/completions",
         {"messages": MESSAGES, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         param="tool_choice.function.name"),
    Case("tool_choice required without tools", "/v1/chat/completions",
         {"messages": MESSAGES, "tool_choice": "required"}, param="tool_choice"),
    Case("tools not a list", "/v1/chat/completions", {"messages": MESSAGES, "tools": "get_weather"}, param="tools"),
    Case("tool of unknown type", "/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "retrieval"}]},
         param="tools[0].type"),
    Case("tool without a name", "/v1/chat/completions",
         {"messages": MESSAGES, "tools": [{"type": "function", "function": {}}]}, param="tools[0].function.name"),
    Case("tool name with spaces", "/v1/chat/completions",
         {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "get weather"}}]},
         param="tools[0].function.name"),
    Case("tool name with a trailing newline", "/v1/chat/completions",
         {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "get_weather\n"}}]},
         param="tools[0].function.name"),
    Case("tool parameters a string", "/v1/chat/completions",
         {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f", "parameters": "city"}}]},
         param="tools[0].function.parameters"),
    Case("tool parameters invalid schema", "/v1/chat/completions",
         {"messages": MESSAGES, "tools": [{"type": "function", "function": {
             "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}], **ONE},
         param="tools[0].function.parameters"),
    Case("two tools with one name", "/v1/chat/completions",
         {"messages": MESSAGES, "tools": [TOOL, TOOL], **ONE}, param="tools[1].function.name"),
    # ---- the other routes ----------------------------------------------------------------------------
    Case("abort rid a number", "/abort_request", {"rid": 5}, param="rid"),
    Case("abort without target", "/abort_request", {}),
    Case("abort with both targets", "/abort_request", {"rid": "x", "abort_all": True}),
    Case("abort_all a string", "/abort_request", {"abort_all": "yes"}, param="abort_all"),
    Case("abort body broken", "/abort_request", "{"),
    Case("flush_cache with PUT", "/flush_cache", method="PUT", status=405),
    Case("generate with GET", "/generate", method="GET", status=405),
    Case("chat with DELETE", "/v1/chat/completions", method="DELETE", status=405),
    Case("unknown route", "/v1/audio/transcriptions", {"input": "x"}, status=404),
    # /v1/embeddings exists now: on a generation server it is a 400 naming model.
    Case("embeddings on a generation server", "/v1/embeddings", {"input": "x"}, param="model"),
    Case("unknown model", "/v1/chat/completions", {"model": "gpt-4", "messages": MESSAGES}, status=404,
         param="model"),
    Case("retrieve unknown model", "/v1/models/gpt-4", method="GET", status=404, param="model"),
    # ---- oversized bodies ------------------------------------------------------------------------------
    Case("oversized body", "/v1/completions", _OVERSIZE, status=413),
    Case("oversized chunked body", "/generate", _chunked_oversize, status=413),
]

# Valid but hostile: regexes that backtrack catastrophically in a backtracking engine. The grammar
# compiles them to an automaton, so each is served (200, output matching) or refused (400), in seconds.
HOSTILE_REGEXES = ["(a+)+$", "(a|aa)*b", "(x+x+)+y", "(a|a?)+c", "(.*a){12}"]


def check_error_body(payload: Any) -> dict[str, Any]:
    """The `error` object of an OpenAI-style error body (asserting its shape)."""
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    return error

