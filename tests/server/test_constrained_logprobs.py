"""Logprobs of a constrained request over HTTP: finite numbers, only the alternatives the grammar allowed.

Masked alternatives have logprob -inf, which JSON cannot carry: the reply
was a 500 ("Out of range float values are not JSON compliant"). The top
lists are taken after the mask and leave those out (`sampling.finite_top_pairs`),
so a list may be shorter than ``top_logprobs``.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
TOP = 5
BASE = {"temperature": 0, "max_tokens": 12, "response_format": RESPONSE_FORMAT}

# The worker builds the per-request top lists (runtime/model_worker.py, ModelWorker.sample); until it
# reads them with `TokenLogprobs.top_pairs` the replies are still 500s. Strict: remove it with that change.


def chat_body(stream: bool) -> dict:
    return {**BASE, "messages": [{"role": "user", "content": "ok?"}], "logprobs": True, "top_logprobs": TOP,
            "stream": stream}


def completion_body(stream: bool) -> dict:
    return {**BASE, "prompt": "ok?", "logprobs": TOP, "stream": stream}


def post(http: httpx.Client, route: str, body: dict) -> list[dict]:
    """The reply (one object) or the stream's chunks; asserts a 200 with strict JSON throughout."""
    if not body["stream"]:
        reply = http.post(route, json=body)
        assert reply.status_code == 200, reply.text
        return [json.loads(reply.text, parse_constant=_no_constant)]
    chunks = []
    with http.stream("POST", route, json=body) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):], parse_constant=_no_constant))
    assert chunks and "error" not in chunks[-1], chunks[-1:]
    return chunks


def _no_constant(name: str):
    raise AssertionError(f"{name} in a reply: not JSON")


def check_top_lists(entries: list[tuple[float, list[float]]]) -> None:
    """(chosen logprob, its alternatives' logprobs) per token: finite, at most TOP, at least the chosen."""
    assert entries
    for logprob, alternatives in entries:
        assert math.isfinite(logprob) and logprob <= 0
        assert 1 <= len(alternatives) <= TOP and all(math.isfinite(a) for a in alternatives)
        assert alternatives == sorted(alternatives, reverse=True)
    assert any(len(alternatives) < TOP for _, alternatives in entries)  # where the grammar left fewer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_of_a_constrained_request(http, stream):
    chunks = post(http, "/v1/chat/completions", chat_body(stream))
    content = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    check_top_lists([(e["logprob"], [t["logprob"] for t in e["top_logprobs"]]) for e in content])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_of_a_constrained_request(http, stream):
    chunks = post(http, "/v1/completions", completion_body(stream))
    entries = []
    for c in chunks:
        logprobs = c["choices"][0].get("logprobs") or {}
        entries += zip(logprobs.get("token_logprobs") or [], logprobs.get("top_logprobs") or [])
    check_top_lists([(lp, sorted(top.values(), reverse=True)) for lp, top in entries])
