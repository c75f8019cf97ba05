"""Agent frameworks' tool paths against the server on the embedded model.

Each library forces a tool call the way its users do and must get back one
parsed call: openai-agents' default model (the Responses API) with a forced
tool, ``chat.completions.parse`` with ``pydantic_function_tool``, and
langchain's ``bind_tools(tool_choice=...)`` with ``@tool`` schemas, which say
nothing of ``additionalProperties``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import agents
import langchain_openai as lc_openai
import openai
import pytest
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, Field

from live_server import registry_for, serve
from mlx_cairn.engine import Engine, EngineConfig
from mlx_cairn.testing.engine_checks import assert_at_rest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def live(default_model) -> Iterator[str]:
    engine = Engine(default_model, EngineConfig(max_batch=8, num_blocks=1024))
    try:
        with serve(registry_for({"smol": engine})) as srv:
            yield srv.url
        assert_at_rest(engine)
    finally:
        engine.close()


def test_openai_agents_forced_tool(live: str) -> None:
    agents.set_tracing_disabled(True)
    ran: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        ran.append(city)
        return f"sunny in {city}"

    async def run(choice: str) -> Any:
        async with openai.AsyncOpenAI(
            base_url=live + "/v1", api_key="unused", max_retries=0
        ) as client:
            agent = agents.Agent(
                name="weather",
                instructions="Answer questions about the weather.",
                tools=[get_weather],
                model=agents.OpenAIResponsesModel("smol", client),
                model_settings=agents.ModelSettings(
                    tool_choice=choice, temperature=0.0, max_tokens=120
                ),
                tool_use_behavior="stop_on_first_tool",
            )
            return await agents.Runner.run(agent, "What is the weather in Paris?")

    for choice in ("required", "get_weather"):
        ran.clear()
        result = asyncio.run(run(choice))
        assert len(ran) == 1, ran
        assert result.final_output == f"sunny in {ran[0]}"


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(description="The city")
    unit: str = Field(description="celsius or fahrenheit")


def test_chat_parse_with_pydantic_function_tool(live: str) -> None:
    client = openai.OpenAI(base_url=live + "/v1", api_key="unused", max_retries=0)
    for temperature in (0.0, 0.8):
        done = client.chat.completions.parse(
            model="smol",
            messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
            tools=[openai.pydantic_function_tool(GetWeather)],
            tool_choice={"type": "function", "function": {"name": "GetWeather"}},
            temperature=temperature,
            seed=1,
            max_tokens=120,
        )
        msg = done.choices[0].message
        assert done.choices[0].finish_reason == "tool_calls", done
        assert msg.tool_calls is not None and len(msg.tool_calls) == 1
        assert isinstance(msg.tool_calls[0].function.parsed_arguments, GetWeather)
    client.close()


def test_langchain_bind_tools_with_an_open_schema(live: str) -> None:

    @tool
    def search(query: str, limit: int) -> str:
        """Search the web for news."""
        return query

    # What langchain sends: a schema silent on other keys.
    sent = convert_to_openai_tool(search)["function"]["parameters"]
    assert "additionalProperties" not in sent, sent
    llm = lc_openai.ChatOpenAI(
        model="smol",
        base_url=live + "/v1",
        api_key="unused",
        max_retries=0,
        temperature=0.8,
        seed=3,
        max_tokens=160,
    )
    # Named: exactly one call. "any" (required): at least one, then the model may stop.
    for choice in ("search", "any"):
        msg = llm.bind_tools([search], tool_choice=choice).invoke("Find news about llamas.")
        assert msg.response_metadata["finish_reason"] == "tool_calls", msg
        assert len(msg.tool_calls) == 1 if choice == "search" else msg.tool_calls, msg
        for call in msg.tool_calls:
            assert call["name"] == "search"
            assert set(call["args"]) == {"query", "limit"}, call
            assert isinstance(call["args"]["limit"], int)
