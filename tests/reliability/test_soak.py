"""Concurrency soak: a fixed mix of requests (plain, streaming, JSON schema, tools, /generate,
client aborts and aborts by id) from many concurrent clients. Every request that is not
aborted completes; the pools end whole; the resident memory of the server and its scheduler
after the run is within 10% of before it (after a warm-up round of the same mix)."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import jsonschema

from tests.reliability.bad_requests import TOOL
from tests.reliability.conftest import assert_pools_whole, process_tree, rss_bytes
from tests.server.conftest import API_KEY

NUM_CLIENTS = 24
WARMUP_REQUESTS = 48
SOAK_REQUESTS = 96
KINDS = ("plain", "stream", "json", "tools", "generate", "drop", "abort_by_id", "completions_stream")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


async def _request(client: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    """Run request `i` of the mix; returns its kind, or raises when it did not complete as it should."""
    kind = KINDS[i % len(KINDS)]
    messages = [{"role": "user", "content": f"Request {i}: tell me about the number {rng.randint(0, 999)}"}]
    chat = {"messages": messages, "max_tokens": rng.randint(4, 12), "temperature": 0.7, "seed": i}
    if kind == "plain":
        out = await _post(client, "/v1/chat/completions", chat)
        assert out["choices"][0]["finish_reason"] in ("stop", "length")
    elif kind == "stream":
        events = await _sse(client, "/v1/chat/completions", {**chat, "stream": True})
        assert json.loads(events[-1])["choices"][0]["finish_reason"] in ("stop", "length")
    elif kind == "json":
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
        out = await _post(client, "/v1/chat/completions", {**chat, "max_tokens": 48, "response_format": fmt})
        choice = out["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    elif kind == "tools":
        out = await _post(client, "/v1/chat/completions", {**chat, "max_tokens": 40, "tools": [TOOL],
                                                           "tool_choice": "required"})
        choice = out["choices"][0]
        if choice["finish_reason"] == "tool_calls":
            assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    elif kind == "generate":
        out = await _post(client, "/generate", {"text": messages[0]["content"],
                                                "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
        assert out["meta_info"]["completion_tokens"] == 8
    elif kind == "completions_stream":
        events = await _sse(client, "/v1/completions", {"prompt": messages[0]["content"], "max_tokens": 8,
                                                         "stream": True})
        assert json.loads(events[-1])["choices"][0]["finish_reason"] in ("stop", "length")
    elif kind == "drop":
        body = {**chat, "stream": True, "max_tokens": 64, "ignore_eos": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for _ in response.aiter_lines():
                break
    else:  # abort_by_id: a long /generate stream aborted through /abort_request
        rid = f"soak-{i}-{rng.random()}"
        body = {"text": "abort me", "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        async with client.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    break
            assert (await client.post("/abort_request", json={"rid": rid})).json()["success"]
            last = [line async for line in lines if line.startswith("data: {")][-1]
            assert json.loads(last[len("data: "):])["meta_info"]["finish_reason"]["type"] == "abort"
    return kind


async def _post(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text[:300]
    return response.json()


async def _sse(client: httpx.AsyncClient, path: str, body: dict) -> list[str]:
    """The JSON events of a stream (without [DONE]); the stream must end with [DONE] and no error."""
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        events = [line[len("data: "):] async for line in response.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and not any('"error"' in e[:10] for e in events), events[-3:]
    chunks = [e for e in events[:-1] if json.loads(e).get("choices")]
    return chunks


async def _run(base_url: str, num_requests: int, seed: int) -> list[str | BaseException]:
    """`num_requests` of the mix, taken by `NUM_CLIENTS` clients from one shared counter."""
    rng = random.Random(seed)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)
    results: list[str | BaseException] = [""] * num_requests

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            try:
                results[i] = await _request(client, i, random.Random(rng.random()))
            except Exception as e:  # noqa: BLE001 - collected and reported by the test
                results[i] = e

    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(NUM_CLIENTS)))
    return results


def _server_rss(pid: int) -> int:
    return rss_bytes(process_tree(pid))


async def _compile_grammars(base_url: str) -> None:
    """One JSON and one tools request alone, so their grammars are compiled before the load."""
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=120) as client:
        for i in (KINDS.index("json"), KINDS.index("tools")):
            await _request(client, i, random.Random(i))


def test_soak_completes_everything_and_keeps_memory_flat(main_server, tally):
    asyncio.run(_compile_grammars(main_server.base_url))
    warm = asyncio.run(_run(main_server.base_url, WARMUP_REQUESTS, seed=1))
    assert not [r for r in warm if isinstance(r, BaseException)], [r for r in warm if isinstance(r, BaseException)]
    with main_server.client() as http:
        assert_pools_whole(http)
    before = _server_rss(main_server.process.pid)
    results = asyncio.run(_run(main_server.base_url, SOAK_REQUESTS, seed=2))
    tally["concurrency soak"][0] += SOAK_REQUESTS
    failures = {i: repr(r) for i, r in enumerate(results) if isinstance(r, BaseException)}
    tally["concurrency soak"][1] += SOAK_REQUESTS - len(failures)
    assert not failures, failures
    assert sorted(set(results)) == sorted(KINDS)
    with main_server.client() as http:
        assert_pools_whole(http)
        assert http.get("/health").status_code == 200
    after = _server_rss(main_server.process.pid)
    assert after <= before * 1.10, f"resident memory grew from {before / 2**20:.0f} MiB to {after / 2**20:.0f} MiB"
