"""Abort storm: 200 streaming requests at once, half of them dropped by the client at random
points (before the answer, after a few events); the other half must finish whole, and once
everything drains and the cache is flushed every KV slot and request row is free and
nothing is left queued or running."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from tests.reliability.conftest import assert_pools_whole
from tests.server.conftest import API_KEY

NUM_REQUESTS = 200
MAX_TOKENS = 10


async def _one(client: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    """Run request `i`; even ones are dropped by the client. Returns how it ended."""
    drop = i % 2 == 0
    path, body = ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Count to {i}"}]}) \
        if i % 3 else ("/v1/completions", {"prompt": f"Story number {i}:"})
    body.update(stream=True, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=i)
    if i % 5 == 0:
        path, body = "/generate", {"text": f"Item {i}", "stream": True,
                                   "sampling_params": {"max_new_tokens": MAX_TOKENS, "ignore_eos": True}}
    if drop and i % 10 == 0:  # hang up before the answer starts: cancel the request mid-flight
        task = asyncio.ensure_future(client.post(path, json=body))
        await asyncio.sleep(rng.uniform(0, 0.5))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "dropped"
        return "finished before the drop"
    keep = rng.randint(0, MAX_TOKENS - 2) if drop else None
    events = []
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if keep is not None and len(events) > keep:
                return "dropped"  # leaving the block closes the connection
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    if path == "/generate":
        assert chunks[-1]["meta_info"]["completion_tokens"] == MAX_TOKENS
    else:
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert reasons[-1] == "length", reasons
    return "finished"


async def _storm(base_url: str) -> list[str]:
    rng = random.Random(20240607)
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=120, limits=limits) as client:
        return await asyncio.gather(*(_one(client, i, random.Random(rng.random())) for i in range(NUM_REQUESTS)))


def test_abort_storm_leaves_every_pool_whole(main_server, tally):
    with main_server.client() as http:
        generated_before = http.get("/get_server_info").json()["num_generated_tokens"]
    outcomes = asyncio.run(_storm(main_server.base_url))
    tally["abort storm"][0] += NUM_REQUESTS
    finished = [i for i, o in enumerate(outcomes) if o != "dropped"]
    assert all(i % 2 == 1 or outcomes[i] == "finished before the drop" for i in finished)
    assert len([o for o in outcomes if o == "finished"]) >= NUM_REQUESTS // 2  # every kept request finished
    with main_server.client() as http:
        info = assert_pools_whole(http)
        assert http.get("/health").status_code == 200
    # the dropped requests stopped early: fewer tokens than 200 full answers
    assert info["num_generated_tokens"] - generated_before < NUM_REQUESTS * MAX_TOKENS
    tally["abort storm"][1] += NUM_REQUESTS
