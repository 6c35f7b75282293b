"""KV pressure: a server whose KV pool (400 tokens) is too small for its running batch must
evict cached prefixes and retract running requests, never fail them, and give the same
greedy outputs as the roomy main server. A request that can never fit the pool is refused
with a 400, not left waiting forever."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from tests.reliability.bad_requests import check_error_body
from tests.reliability.conftest import PRESSURED_POOL_TOKENS, assert_pools_whole
from tests.server.conftest import API_KEY

NUM_REQUESTS = 14
MAX_NEW_TOKENS = 40


def _prompts() -> list[list[int]]:
    """Prompts of 8 to 40 tokens; half share a 16-token prefix (cached, then evicted under pressure)."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 49152) for _ in range(16)]
    prompts = []
    for i in range(NUM_REQUESTS):
        tail = [rng.randrange(3, 49152) for _ in range(rng.randint(8, 24))]
        prompts.append(shared + tail if i % 2 else tail)
    return prompts


def _body(ids: list[int], max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    return {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                  "ignore_eos": True}}


async def _run_all(base_url: str, prompts: list[list[int]]) -> list[list[int]]:
    """Every prompt as its own concurrent request (half of them streamed); their output ids."""

    async def one(client: httpx.AsyncClient, i: int, ids: list[int]) -> list[int]:
        if i % 2:
            response = await client.post("/generate", json=_body(ids))
            assert response.status_code == 200, response.text
            out = response.json()
            assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
            return out["output_ids"]
        last = None
        async with client.stream("POST", "/generate", json={**_body(ids), "stream": True}) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    last = line
        out = json.loads(last[len("data: "):])
        assert "error" not in out, out
        assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
        return out["output_ids"]

    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=180) as client:
        return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))


def test_pressure_retracts_and_keeps_greedy_outputs(pressured_server, main_server, tally):
    prompts = _prompts()
    assert sum(len(p) + MAX_NEW_TOKENS for p in prompts) > 2 * PRESSURED_POOL_TOKENS
    tally["kv pressure"][0] += NUM_REQUESTS
    reference = asyncio.run(_run_all(main_server.base_url, prompts))
    with pressured_server.client() as http:
        before = http.get("/get_server_info").json()
        warm = asyncio.run(_run_all(pressured_server.base_url, prompts[:4]))  # fill the cache with prefixes
        pressured = asyncio.run(_run_all(pressured_server.base_url, prompts))
        info = assert_pools_whole(http)
    assert warm == reference[:4]
    for i, (got, want) in enumerate(zip(pressured, reference)):
        assert got == want, f"request {i} changed under KV pressure"
    assert info["num_retractions"] > before["num_retractions"], "the pool was never short: no retraction"
    tally["kv pressure"][1] += NUM_REQUESTS


def test_request_larger_than_the_pool_is_refused(pressured_server, tally):
    """Fits the context (1024) but not the 400-token pool: a 400 now, not a wait forever."""
    cases = [_body([5] * 300, 200), _body([5] * (PRESSURED_POOL_TOKENS + 10), 4),
             {**_body([5] * 300, 200), "stream": True}]
    tally["kv pressure"][0] += len(cases)
    with pressured_server.client() as http:
        for body in cases:
            response = http.post("/generate", json=body, timeout=30)
            assert response.status_code == 400, response.text[:300]
            assert check_error_body(response.json())["param"] in ("input_ids", "max_new_tokens")
            tally["kv pressure"][1] += 1
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 4}, timeout=30)
        assert chat.status_code == 200, chat.text[:300]
        assert_pools_whole(http)
