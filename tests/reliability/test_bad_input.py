"""Bad input: every malformed request of `bad_requests.CASES` gets a 4xx with an OpenAI-style
error body (never a 500, never a hang); afterwards the server is healthy and answers a normal
greedy request exactly as before the battery."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.reliability.bad_requests import CASES, HOSTILE_REGEXES, MESSAGES, Case, check_error_body
from tests.reliability.conftest import assert_pools_whole
from tests.server.conftest import API_KEY

GREEDY_IDS = {"input_ids": [1, 504, 3158, 2777, 28, 4837, 4914], "sampling_params": {
    "temperature": 0, "max_new_tokens": 16, "ignore_eos": True}}
GREEDY_CHAT = {"messages": MESSAGES, "temperature": 0, "max_tokens": 16, "ignore_eos": True}


def _greedy(client: httpx.Client) -> tuple[list[int], str]:
    native = client.post("/generate", json=GREEDY_IDS)
    chat = client.post("/v1/chat/completions", json=GREEDY_CHAT)
    assert native.status_code == 200 and chat.status_code == 200, (native.text, chat.text)
    return native.json()["output_ids"], chat.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def http(main_server):
    with main_server.client() as client:
        yield client


@pytest.fixture(scope="module")
def before(http):
    """The greedy outputs before any bad request."""
    return _greedy(http)


def test_battery_is_large_enough():
    assert len(CASES) >= 50
    assert len({c.name for c in CASES}) == len(CASES)
    routes = {c.path for c in CASES}
    assert {"/generate", "/v1/completions", "/v1/chat/completions", "/abort_request", "/flush_cache"} <= routes


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request_gets_4xx(http, before, tally, case: Case):
    tally["bad input"][0] += 1
    response = http.request(case.method, case.path, content=case.content(),
                            headers={"content-type": "application/json"})
    assert response.status_code == case.status, response.text[:500]
    error = check_error_body(response.json())
    if case.param is not None:
        assert error["param"] == case.param, error
    assert http.get("/health").status_code == 200
    tally["bad input"][1] += 1


@pytest.mark.parametrize("regex", HOSTILE_REGEXES)
def test_backtracking_regex_is_answered(http, before, tally, regex):
    tally["bad input (hostile regex)"][0] += 1
    body = {"text": "x", "sampling_params": {"regex": regex, "max_new_tokens": 8, "temperature": 0}}
    response = http.post("/generate", json=body)
    assert response.status_code in (200, 400), response.text[:500]
    if response.status_code == 400:
        assert check_error_body(response.json())["param"] == "regex"
    else:
        out = response.json()
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert re.fullmatch(regex.removesuffix("$"), out["text"]), out["text"]
    tally["bad input (hostile regex)"][1] += 1


def test_missing_api_key_gets_401(main_server, tally):
    tally["bad input"][0] += 1
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{main_server.base_url}/v1/completions", json={"prompt": "x"}, headers=headers)
        assert response.status_code == 401
        assert check_error_body(response.json())["code"] == "invalid_api_key"
    tally["bad input"][1] += 1


def test_streamed_bad_request_is_refused_before_the_stream(http, before, tally):
    tally["bad input"][0] += 1
    body = {"messages": MESSAGES, "stream": True, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 400
        error = check_error_body(json.loads(response.read()))
    assert error["param"] == "response_format.json_schema.schema"
    tally["bad input"][1] += 1


def test_server_unchanged_after_the_battery(http, before):
    """Last: healthy, the same greedy outputs, every pool whole."""
    assert http.get("/health").status_code == 200
    assert _greedy(http) == before
    assert_pools_whole(http)
