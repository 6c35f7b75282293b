"""`/v1/responses` on a reasoning model (`--reasoning-parser qwen3`, Qwen3's template, the scripted
model of `test_reasoning_server.py`, which writes ``<think>Let me think</think>`` then `` The answer``):
the thinking is a `reasoning` output item, never message text, streamed or not; a `text.format`
schema constrains only what follows the reasoning."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from tests.server.conftest import API_KEY, start_server, stop_server, wait_idle
from tests.server.scripted_model import write_scripted_model
from tests.server.test_reasoning_server import SCHEMA, SCRIPT

EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server(smollm_dir, tmp_path_factory):
    folder = write_scripted_model(tmp_path_factory.mktemp("scripted_qwen3_responses"), smollm_dir, SCRIPT)
    srv = start_server(folder, folder / "server.log", "--chat-template", "qwen3", "--reasoning-parser", "qwen3")
    yield srv
    stop_server(srv)


@pytest.fixture
def client(server):
    yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with server.client() as http:
        info = wait_idle(http)
        assert info["free_req_rows"] == info["total_req_rows"]


def test_reasoning_item_then_message(client):
    resp = client.responses.create(model="default", input="Is Paris in France?", temperature=0,
                                   max_output_tokens=40)
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "Let me think"
    assert resp.output_text.strip() == "The answer" and "think" not in resp.output_text
    assert 0 < resp.usage.output_tokens_details.reasoning_tokens < resp.usage.output_tokens


def test_streamed_reasoning_events(client):
    events = list(client.responses.create(model="default", input="Is Paris in France?", temperature=0,
                                          max_output_tokens=40, stream=True))
    for ev in events:
        EVENTS.validate_python(ev.model_dump())
    thinking = "".join(ev.delta for ev in events if ev.type == "response.reasoning_text.delta")
    text = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    assert thinking == "Let me think" and text.strip() == "The answer"
    final = events[-1].response
    assert events[-1].type == "response.completed" and [i.type for i in final.output] == ["reasoning", "message"]


def test_schema_after_the_reasoning(client):
    resp = client.responses.create(
        model="default", input="Is Paris in France?", temperature=0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}})
    assert resp.status == "completed" and resp.output[0].type == "reasoning"
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)
