"""`arborlm serve` end to end on the tiny random Llama, driven by the `openai` client and httpx.

The server is shared with the other modules here (see conftest.py); the last test shuts it down
with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, wait_idle

GREEDY = {"temperature": 0, "max_tokens": 12}
FORCE_LENGTH = {"ignore_eos": True}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


# ---- OpenAI API ----------------------------------------------------------------


def test_models_list_and_retrieve(client, model, server):
    assert model == server.model_dir
    assert client.models.retrieve("default").id == model
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.models.retrieve("gpt-4")
    assert excinfo.value.body["code"] == "model_not_found"


@pytest.mark.usefixtures("http")
def test_chat_stream_equals_non_stream_under_greedy(client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES, extra_body=FORCE_LENGTH, **GREEDY)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body=FORCE_LENGTH, **GREEDY))
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.model_extra["matched_stop"] is None
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert full.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
    # the second call found the prompt in the radix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.usefixtures("http")
def test_completions_stream_equals_non_stream_under_greedy(client, model):
    kwargs = dict(model=model, prompt="The quick brown fox", extra_body=FORCE_LENGTH, **GREEDY)
    full = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == full.choices[0].text and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12


@pytest.mark.usefixtures("http")
def test_completions_prompt_forms_and_n(client, model, tiny_tokenizer):
    ids = tiny_tokenizer.encode("hello world", add_special_tokens=False)
    by_text = client.completions.create(model=model, prompt="hello world", **GREEDY)
    by_ids = client.completions.create(model=model, prompt=ids, **GREEDY)
    assert by_text.choices[0].text == by_ids.choices[0].text
    batch = client.completions.create(model=model, prompt=[ids, [5, 6, 7]], n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == by_text.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + 3  # the prompt counts once, whatever n


@pytest.mark.usefixtures("http")
def test_chat_n_choices_and_seed(client, model):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7, n=3,
                  extra_body=FORCE_LENGTH)
    out = client.chat.completions.create(**kwargs)
    assert len(out.choices) == 3 and [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) > 1
    again = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]


@pytest.mark.usefixtures("http")
def test_chat_logprobs(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, logprobs=True, top_logprobs=3,
                                         extra_body=FORCE_LENGTH, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 12
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy takes the top; one source for both


@pytest.mark.usefixtures("http")
def test_response_format_json_schema_validates(client, model):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    out = client.chat.completions.create(model=model, messages=MESSAGES, response_format=fmt,
                                         temperature=0, max_tokens=40)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    obj = client.chat.completions.create(model=model, messages=MESSAGES, response_format={"type": "json_object"},
                                         temperature=0, max_tokens=40)
    assert obj.choices[0].finish_reason in ("stop", "length")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.usefixtures("http")
def test_huge_enum_schema_is_answered_in_seconds(client, model):
    # the enum was deduplicated in quadratic time on the event loop: minutes, the whole server blocked
    values = [f"value-{i}" for i in range(20000)]
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": {"type": "string", "enum": values}}}
    start = time.monotonic()
    out = client.chat.completions.create(model=model, messages=MESSAGES, response_format=fmt,
                                         temperature=0, max_tokens=16)
    assert time.monotonic() - start < 60
    if out.choices[0].finish_reason == "stop":
        assert json.loads(out.choices[0].message.content) in values


@pytest.mark.usefixtures("http")
def test_output_failing_its_schema_says_why(client, model, http):
    # uniqueItems over strings is enforced by no backend, so a lenient request (strict unset)
    # leaves it out of the grammar, which forces ["", ""]: validation must fail
    schema = {"type": "array", "items": {"type": "string", "maxLength": 0}, "minItems": 2, "maxItems": 2,
              "uniqueItems": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "pair", "schema": schema}}
    violations = http.get("/get_server_info").json()["num_grammar_violations"]
    out = client.chat.completions.create(model=model, messages=MESSAGES, response_format=fmt,
                                         temperature=0, max_tokens=20)
    choice = out.choices[0]
    assert choice.finish_reason == "abort"
    assert "does not satisfy" in choice.model_extra["abort_message"]
    assert "non-unique" in choice.model_extra["abort_message"]
    last = [c for c in client.chat.completions.create(model=model, messages=MESSAGES, response_format=fmt,
                                                      temperature=0, max_tokens=20, stream=True) if c.choices][-1]
    assert last.choices[0].finish_reason == "abort" and "does not satisfy" in last.choices[0].model_extra["abort_message"]
    assert http.get("/get_server_info").json()["num_grammar_violations"] == violations + 2


def test_the_default_backend_enforces_what_xgrammar_would_drop(http):
    # A lenient schema xgrammar takes only without uniqueItems (over an enum): the default,
    # auto, gives it to llguidance, which enforces it, so every output is a valid pair
    # (dropped, ["a", "a"] would come about half the time and fail validation).
    schema = {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
    violations = http.get("/get_server_info").json()["num_grammar_violations"]
    params = {"json_schema": json.dumps(schema), "json_schema_lenient": True, "temperature": 1.0, "max_new_tokens": 24}
    outs = http.post("/generate", json={"text": ["Pick"] * 6, "sampling_params": params}).json()
    for out in outs:
        assert out["meta_info"]["grammar_backend"] == "llguidance", out["meta_info"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert sorted(json.loads(out["text"])) == ["a", "b"]
    assert http.get("/get_server_info").json()["num_grammar_violations"] == violations


@pytest.mark.usefixtures("http")
def test_completions_max_tokens_null_is_16(http):
    body = {"model": "default", "prompt": "Once upon", "max_tokens": None, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 16


@pytest.mark.usefixtures("http")
def test_continue_final_message_and_content_parts(client, model):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a colour."}]},
             {"role": "assistant", "content": "My answer is"}]
    out = client.chat.completions.create(model=model, messages=parts, extra_body={"continue_final_message": True,
                                                                                  **FORCE_LENGTH}, **GREEDY)
    assert out.usage.completion_tokens == 12


@pytest.mark.usefixtures("http")
def test_chat_template_kwargs_reach_the_template(client, model):
    """Template variables the template does not use change nothing; they are not refused."""
    plain = client.chat.completions.create(model=model, messages=MESSAGES, extra_body=FORCE_LENGTH, **GREEDY)
    with_vars = client.chat.completions.create(
        model=model, messages=MESSAGES, extra_body={"chat_template_kwargs": {"enable_thinking": False}, **FORCE_LENGTH},
        **GREEDY,
    )
    assert with_vars.choices[0].message.content == plain.choices[0].message.content
    assert with_vars.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.usefixtures("http")
def test_stop_string_and_logit_bias(client, model, tiny_tokenizer):
    token = tiny_tokenizer.encode(" banana", add_special_tokens=False)[0]
    piece = tiny_tokenizer.decode([token])
    out = client.completions.create(model=model, prompt="x", logit_bias={str(token): 100}, **GREEDY)
    assert out.choices[0].text == piece * 12
    stop = (piece * 2)[len(piece) - 2: len(piece) + 2]  # spans two tokens
    stopped = client.completions.create(model=model, prompt="x", logit_bias={str(token): 100}, stop=[stop], **GREEDY)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["matched_stop"] == stop
    assert stopped.choices[0].text == (piece * 12)[: (piece * 12).index(stop)]


@pytest.mark.usefixtures("http")
def test_32_concurrent_requests(server, model):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
        calls = [aclient.chat.completions.create(model=model, max_tokens=6, temperature=0, extra_body=FORCE_LENGTH,
                                                 messages=[{"role": "user", "content": f"Count to {i}"}])
                 for i in range(32)]
        try:
            return await asyncio.gather(*calls)
        finally:
            await aclient.close()

    outs = asyncio.run(run())
    assert len(outs) == 32 and all(o.usage.completion_tokens == 6 for o in outs)


# ---- native API ------------------------------------------------------------------


def test_native_generate_single_batch_stream(http):
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    one = http.post("/generate", json={"text": "Hello there", "sampling_params": params}).json()
    assert one["meta_info"]["completion_tokens"] == 8 and one["meta_info"]["finish_reason"]["type"] == "length"
    batch = http.post("/generate", json={"text": ["Hello there", "Bye"], "sampling_params": params}).json()
    assert [b["output_ids"] for b in batch][0] == one["output_ids"]
    by_ids = http.post("/generate", json={"input_ids": [[1, 2, 3]], "sampling_params": params}).json()
    assert isinstance(by_ids, list) and len(by_ids[0]["output_ids"]) == 8
    events = _sse(http, "/generate", {"text": "Hello there", "sampling_params": params, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["text"] == one["text"] and chunks[-1]["output_ids"] == one["output_ids"]  # cumulative


def test_native_logprobs(http):
    out = http.post("/generate", json={"text": "Hello", "return_logprob": True, "top_logprobs_num": 2,
                                       "return_text_in_logprobs": True,
                                       "sampling_params": {"temperature": 0, "max_new_tokens": 3}}).json()
    meta = out["meta_info"]
    assert len(meta["output_token_logprobs"]) == len(out["output_ids"])
    logprob, token_id, text = meta["output_token_logprobs"][0]
    assert token_id == out["output_ids"][0] and isinstance(text, str) and logprob <= 0
    assert len(meta["output_top_logprobs"][0]) == 2


def test_native_info_health_flush_metrics(http, server):
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["is_generation"] and info["vocab_size"] == 49152
    server_info = http.get("/get_server_info").json()
    assert server_info["api_key"] == "<redacted>" and server_info["max_total_tokens"] == 8192
    assert {"num_running_reqs", "num_waiting_reqs", "free_kv_tokens", "cache_hit_rate"} <= set(server_info)
    assert http.post("/flush_cache").json()["success"]
    metrics = http.get("/metrics").text
    for name in ("arborlm:num_running_reqs", "arborlm:num_queue_reqs", "arborlm:token_usage",
                 "arborlm:cache_hit_rate", "arborlm:prompt_tokens_total", "arborlm:generation_tokens_total",
                 "arborlm:time_to_first_token_seconds_bucket", "arborlm:inter_token_latency_seconds_bucket",
                 "arborlm:e2e_request_latency_seconds_bucket"):
        assert name in metrics


def test_abort_request_by_id(http, server):
    got = {}

    def stream():
        got["events"] = _sse(http, "/generate", {"text": "abort me", "rid": "to-abort", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}})

    thread = threading.Thread(target=stream)
    thread.start()
    _wait_in_flight(http, 1)
    assert http.post("/abort_request", json={"rid": "to-abort"}).json()["success"]
    thread.join(30)
    last = json.loads(got["events"][-2])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"


# ---- robustness ------------------------------------------------------------------


def test_client_disconnect_mid_stream_frees_kv(http, server):
    # 900 tokens take the tiny model about a second; the client hangs up after the first event.
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 900, "stream": True, "ignore_eos": True}
    generated_before = http.get("/get_server_info").json()["num_generated_tokens"]
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        next(response.iter_lines())
    info = wait_idle(http)
    assert info["num_running_reqs"] == 0
    assert info["free_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]
    assert info["num_generated_tokens"] - generated_before < 900  # stopped before its max_tokens


def test_duplicate_request_id_in_flight_and_full_queue(http, server):
    got = {}

    def stream():
        got["events"] = _sse(http, "/generate", {"text": "long", "rid": "dup", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}})

    thread = threading.Thread(target=stream)
    thread.start()
    _wait_in_flight(http, 1)
    second = http.post("/generate", json={"text": "x", "rid": "dup"})
    assert second.status_code == 400 and second.json()["error"]["param"] == "rid"
    # 16 running + 32 queued are allowed; a batch that would exceed it is refused whole
    full = http.post("/generate", json={"text": ["x"] * 48, "sampling_params": {"max_new_tokens": 1}})
    assert full.status_code == 503 and "capacity" in full.json()["error"]["message"]
    http.post("/abort_request", json={"rid": "dup"})
    thread.join(30)


BAD_REQUESTS = [
    ("/v1/chat/completions", "{not json", None),
    ("/v1/chat/completions", "[1, 2]", None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    # more than the server ever holds (16 running + 32 queued): impossible, so 400, not a 503 "retry later"
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 49, "max_tokens": 1}, "n"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 25, "max_tokens": 1}, "n"),
    ("/generate", {"text": "x", "sampling_params": {"n": 49, "max_new_tokens": 1}}, "n"),
    ("/generate", {"text": ["x"] * 49, "sampling_params": {"max_new_tokens": 1}}, "text"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 5000}}, "max_new_tokens"),
    ("/generate", {"input_ids": [5] * 1000, "sampling_params": {"max_new_tokens": 25}}, "max_new_tokens"),
    # two output constraints: was one silently ignored
    ("/v1/chat/completions", {"messages": MESSAGES, "json_schema": {"type": "integer"}, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}}}, "json_schema"),
    ("/v1/completions", {"prompt": "x", "regex": "a+", "response_format": {"type": "json_object"}}, "regex"),
    # schema errors name the OpenAI field, not the native json_schema
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": 3}, "stop"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"1": 500}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, None),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, None),
    ("/v1/chat/completions", {"messages": MESSAGES, "regex": "(", "max_tokens": 2}, None),
    ("/v1/chat/completions", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": MESSAGES, "cache_salt": 5}, "cache_salt"),
    # template variables that collide with apply_chat_template's own arguments
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"conversation": []}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999999]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ("/v1/completions", {}, "prompt"),
    ("/generate", {"text": 3}, "text"),
    ("/generate", {"text": "x", "sampling_params": {"max_tokens": 3}}, "max_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"top_k": 0}}, "top_k"),
    ("/generate", {"text": "x", "unknown": 1}, "unknown"),
    ("/generate", {}, "text"),
    ("/abort_request", {}, None),
]


@pytest.mark.parametrize("path, body, param", BAD_REQUESTS, ids=[f"{p}:{json.dumps(b)[:40]}" for p, b, _ in BAD_REQUESTS])
def test_bad_input_gets_400_and_server_lives(http, path, body, param):
    content = body if isinstance(body, str) else json.dumps(body)
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    if path.startswith("/v1/"):
        assert "json_schema_lenient" not in error["message"]  # a native field; OpenAI's is strict
    assert http.get("/health").status_code == 200


def test_auth_and_unknown_routes(server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # public
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.get(f"{server.base_url}/v1/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with server.client() as http:
        missing = http.post("/v1/nothing", json={})
        assert missing.status_code == 404 and missing.json()["error"]["message"].startswith("Invalid URL")
        unknown = http.post("/v1/chat/completions", json={"model": "gpt-4", "messages": MESSAGES})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    bad_key = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


def test_sigterm_aborts_in_flight_and_frees_the_port(server):
    """Last test: shuts the module's server down."""
    children = _children(server.process.pid)
    assert children, "the scheduler process should be a child of the server"
    got = {}

    def stream():
        with server.client() as http:
            got["events"] = _sse(http, "/v1/completions", {"prompt": "x", "max_tokens": 900, "stream": True,
                                                           "ignore_eos": True})

    thread = threading.Thread(target=stream)
    thread.start()
    with server.client() as http:
        _wait_in_flight(http, 1)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0
    thread.join(30)
    assert got["events"][-1] == "[DONE]"
    assert json.loads(got["events"][-2])["error"]["message"] == "the server is shutting down"
    # The scheduler is joined before exit; multiprocessing's resource tracker follows within moments.
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
    with socket.socket() as sock:  # a new server can listen there (closed connections may be in TIME_WAIT)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", server.port))
        sock.listen()


# ---- helpers ------------------------------------------------------------------------


def _sse(http: httpx.Client, path: str, body: dict) -> list[str]:
    """The `data:` payloads of a server-sent-event response."""
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def _wait_in_flight(http: httpx.Client, count: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while http.get("/get_server_info").json()["num_in_flight_reqs"] < count:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return False
