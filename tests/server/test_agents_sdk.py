"""The OpenAI Agents SDK (`openai-agents`, an optional test dependency) end to end on the tiny model's
server, with its default model (the Responses API), one function tool and a structured `output_type`:
the agent calls the tool, the SDK runs it and sends its output back as a `function_call_output`, and
the agent ends with JSON of its output type (the SDK sends `tools` and `text.format` together)."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from pydantic import BaseModel

from tests.server.conftest import API_KEY

agents = pytest.importorskip("agents")


class Weather(BaseModel):
    sky: Literal["sunny", "rainy"]
    temp_c: int


def test_agent_calls_its_tool_and_answers(server, http):
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"Sunny in {city}, 21 C."

    async def run() -> agents.RunResult:
        client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
        # the SDK's default model class: the Responses API
        model = agents.OpenAIResponsesModel(model="default", openai_client=client)
        # tool_choice=required on the first turn: a random model calls the tool only when made to;
        # the SDK resets it to auto after the call (reset_tool_choice): the next turn is a call or a Weather
        settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                        max_tokens=48)
        agent = agents.Agent(name="weather", instructions="Answer about the weather.", tools=[get_weather],
                             model=model, model_settings=settings, output_type=Weather)
        try:
            return await agents.Runner.run(agent, "Weather in Paris?", max_turns=3)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert seen and set(seen) <= {"Paris", "Rome"}
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, Weather)  # the SDK parsed the answer as its output type
    assert len(result.raw_responses) == len(seen) + 1  # one Responses call per tool call, then the answer
