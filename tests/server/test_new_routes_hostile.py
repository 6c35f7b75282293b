"""Hostile bodies on the routes of issue 21 (/v1/responses, /v1/embeddings, /encode, /tokenize,
/detokenize): each is a 4xx with an OpenAI-style error body, never a 500, and the server keeps serving."""

from __future__ import annotations

import pytest

ROUTES = ["/v1/responses", "/v1/embeddings", "/encode", "/tokenize", "/detokenize"]
BODIES = [
    "null", "[]", "{}", '"text"', b"\xc3\x28\xa0\xa1", '{"input": "\\ud800", "prompt": "\\ud800", "text": "\\ud800"}',
    '{"input": [null], "prompt": [null], "tokens": [null], "text": [null]}',
    '{"input": [{"type": null}], "tokens": [[]], "prompt": [""]}',
    '{"input": [{"role": "user", "content": [null]}]}',
    '{"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}',
    '{"input": [{"role": "system", "content": "only instructions"}]}',
    '{"input": "x", "tools": [null]}', '{"input": "x", "tools": [{"type": "function"}]}',
    '{"input": "x", "tool_choice": {"type": "function"}}', '{"input": "x", "text": {"format": {"type": "xml"}}}',
    '{"input": "x", "metadata": {"a": 1}}', '{"input": "x", "previous_response_id": 7}',
    '{"input": "x", "max_output_tokens": 1e999}', '{"input": [' * 2000 + "]" * 2000 + "}",
]

# Valid after all: an empty prompt tokenizes to no tokens, and no tokens detokenize to "".
VALID = {("/tokenize", 7), ("/detokenize", 7)}


@pytest.mark.parametrize("route", ROUTES)
def test_hostile_bodies_are_4xx(http, route):
    for index, body in enumerate(BODIES):
        content = body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass")
        resp = http.post(route, content=content, headers={"Content-Type": "application/json"})
        if (route, index) in VALID:
            assert resp.status_code == 200, (index, resp.text)
            continue
        assert 400 <= resp.status_code < 500, (index, resp.text)
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], index
    assert http.post("/tokenize", json={"prompt": "still serving"}).status_code == 200
