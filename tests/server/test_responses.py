"""`/v1/responses` with the `openai` client on the tiny model's server: plain, streamed, a function-tool
loop with `function_call_output`, `text.format` json_schema, `previous_response_id` (radix cache hit),
retrieve and delete, and bad input (4xx naming the field; the server keeps serving).

Every body is validated against the `openai` package's own types (`Response`, the stream events)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import NotFoundError, OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.server.conftest import API_KEY

WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False},
    "strict": True,
}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture
def client(server, http) -> OpenAI:
    """The `openai` client on the server (`http` checks afterwards that every slot is back in its pool)."""
    return OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def raw(http, body: dict) -> tuple[int, dict]:
    resp = http.post("/v1/responses", json=body)
    return resp.status_code, resp.json()


def test_plain_response_validates_and_is_stored(client, http):
    resp = client.responses.create(model="default", input="Say hello.", max_output_tokens=8, temperature=0)
    assert resp.object == "response" and resp.status in ("completed", "incomplete")
    body = Response.model_validate(http.get(f"/v1/responses/{resp.id}").json())
    assert body.id == resp.id and body.output_text == resp.output_text
    assert resp.output[0].type == "message" and resp.output[0].content[0].type == "output_text"
    assert resp.usage.output_tokens <= 8 and resp.usage.input_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    if resp.usage.output_tokens == 8:
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"


def test_same_text_streamed_and_not(client):
    """Greedy: the streamed deltas join into the non-streamed text, and the final event carries it."""
    kwargs = dict(model="default", input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                  instructions="Be brief.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    for ev in events:
        EVENTS.validate_python(ev.model_dump())
    types = [ev.type for ev in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    deltas = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == whole.output_text == final.output_text
    assert [ev.text for ev in events if ev.type == "response.output_text.done"] == [whole.output_text]


def test_function_tool_loop(client):
    """tool_choice=required: a valid call; its output goes back by call_id; the model answers in text."""
    first = client.responses.create(model="default", input="Weather in Paris?", tools=[WEATHER_TOOL],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=64,
                                    temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and calls
    for call in calls:
        assert call.name == "get_weather" and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["parameters"])
    history = [{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
               for c in calls]
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": '{"temp_c": 21}'} for c in calls]
    second = client.responses.create(model="default", tools=[WEATHER_TOOL], tool_choice="none",
                                     input=[{"role": "user", "content": "Weather in Paris?"}, *history, *outputs],
                                     max_output_tokens=8, temperature=0)
    assert second.output[0].type == "message"
    assert not [item for item in second.output if item.type == "function_call"]


def test_function_call_streamed_events(client):
    stream = client.responses.create(model="default", input="Weather?", tools=[WEATHER_TOOL], stream=True,
                                     tool_choice={"type": "function", "name": "get_weather"},
                                     max_output_tokens=64, temperature=0)
    events = list(stream)
    for ev in events:
        EVENTS.validate_python(ev.model_dump())
    final = events[-1].response
    assert events[-1].type == "response.completed"
    call = next(item for item in final.output if item.type == "function_call")
    deltas = "".join(ev.delta for ev in events if ev.type == "response.function_call_arguments.delta"
                     and ev.item_id == call.id)
    assert deltas == call.arguments and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    done = [ev for ev in events if ev.type == "response.output_item.done" and ev.item.type == "function_call"]
    assert done and done[0].item.arguments == call.arguments


def test_json_schema_text_format(client):
    resp = client.responses.create(
        model="default", input="A person as JSON.", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), PERSON)
    assert resp.text.format.type == "json_schema"


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_tools_beside_a_text_format(client, tool_choice):
    """The Agents SDK sends both for an agent with an output_type: the answer is calls or JSON of the format."""
    resp = client.responses.create(
        model="default", input="A person, or the weather.", tools=[WEATHER_TOOL], tool_choice=tool_choice,
        parallel_tool_calls=False, max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert resp.status == "completed"
    calls = [item for item in resp.output if item.type == "function_call"]
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["parameters"])
    if calls:
        assert resp.output_text == ""
    else:
        assert tool_choice == "auto"
        jsonschema.validate(json.loads(resp.output_text), PERSON)


def test_previous_response_id_continues_from_the_cache(client):
    first = client.responses.create(model="default", input="Tell me a story.", max_output_tokens=6,
                                    temperature=0)
    second = client.responses.create(model="default", input="And then?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id
    # the second prompt extends the first (prompt + answer): its KV is the radix cache's
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_tool_output_continues_a_previous_response(client):
    """The call ids of a stored response are known to the next one: only the outputs are sent."""
    first = client.responses.create(model="default", input="Weather?", tools=[WEATHER_TOOL], temperature=0,
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=64)
    call = next(item for item in first.output if item.type == "function_call")
    second = client.responses.create(
        model="default", previous_response_id=first.id, tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        max_output_tokens=4, temperature=0)
    assert second.status in ("completed", "incomplete") and second.output
    # the same tools described the same way: the first prompt is a prefix of the second
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_delete_then_404(client, http):
    resp = client.responses.create(model="default", input="Hi", max_output_tokens=2)
    client.responses.delete(resp.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(resp.id)
    status, body = raw(http, {"input": "Hi", "previous_response_id": resp.id, "max_output_tokens": 2})
    assert status == 404 and body["error"]["param"] == "previous_response_id"
    assert body["error"]["code"] == "response_not_found"


def test_store_false_is_not_retrievable(client):
    resp = client.responses.create(model="default", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(resp.id)


BAD_INPUT = [
    ({"model": "default"}, "input"),
    ({"input": [{"type": "computer_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "nope",
                                                    "output": "1"}]}, "input[1].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{not json"}]},
     "input[0].arguments"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     "tools[0].parameters"),
    ({"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "other"}},
     "tool_choice.name"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"},
                                         "strict": True, "x": 1}}, "max_output_tokens": 100000},
     "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": []}, "input"),
    ({"input": "hi", "background": True}, "background"),  # no background mode: refused, not answered inline
    ({"input": "hi", "background": "yes"}, "background"),
    ({"input": "word " * 1100, "truncation": "auto"}, "input"),  # auto drops nothing (docs/agents.md)
]


@pytest.mark.parametrize(("body", "param"), BAD_INPUT)
def test_bad_input_is_a_400_naming_the_field(http, body, param):
    status, answer = raw(http, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
    assert raw(http, {"input": "still serving?", "max_output_tokens": 1})[0] == 200


def test_unknown_response_id_is_404(http):
    resp = http.get("/v1/responses/resp_unknown")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "response_not_found"
    assert http.delete("/v1/responses/resp_unknown").status_code == 404


def test_neutral_and_ignored_fields_are_accepted(http):
    """`include`, `truncation` and `reasoning.effort` are accepted and ignored (docs/agents.md), as is
    `background: false`."""
    body = {"model": "default", "input": "Hi", "max_output_tokens": 2, "background": False,
            "include": ["reasoning.encrypted_content", "message.output_text.logprobs"], "truncation": "auto",
            "reasoning": {"effort": "low", "summary": "auto"}}
    resp = http.post("/v1/responses", json=body)
    assert resp.status_code == 200, resp.json()
    Response.model_validate(resp.json())
    assert resp.json()["status"] in ("completed", "incomplete")


def test_seed_through_extra_body(client):
    """docs/agents.md: openai 3.x's responses.create has no `seed`; `extra_body` carries it, and the
    same seed gives the same sampled text."""
    def sampled(seed: int) -> str:
        return client.responses.create(model="default", input="Pick a word.", temperature=1.0,
                                       max_output_tokens=12, extra_body={"seed": seed}).output_text

    first = sampled(7)
    assert sampled(7) == first
    assert any(sampled(s) != first for s in (8, 9, 10))  # the seed reaches the sampler
