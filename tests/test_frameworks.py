"""Agent frameworks, unchanged, against a running gateway (`pdserve up --colocated` on the
bundled model, its default hermes tool parser): LangChain's ChatOpenAI (invoke, stream, tools,
structured output), the OpenAI Agents SDK over chat completions and over the Responses API
(a function tool, a typed final output), and instructor (a pydantic model through a named tool
and through a json_schema response_format, whole and streamed as partial objects). They
send what they send: no field is stripped for them.

instructor pins `jiter<0.15` while openai >= 3.4 needs jiter >= 0.16, so pip cannot install it
beside the openai client with its dependencies: the README's test command installs it with
`--no-deps` (its other dependencies are in the test extra), and it runs on the newer jiter."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from cluster import Cluster, run_cluster
from pydantic import BaseModel

pytestmark = pytest.mark.slow
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("frameworks")
    with run_cluster(tmp, "--colocated", "--dtype", "float32", "--kv-cache-memory",
                     str(64 << 20), "--max-model-len", "1024") as c:
        yield c


def test_langchain_chat_invoke_stream_tools_and_structured_output(server: Cluster) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="-", temperature=0,
                     max_tokens=24, max_retries=0)
    answer = llm.invoke("What is the capital of France?")
    assert isinstance(answer.content, str) and answer.content
    assert "".join(c.content for c in llm.stream("What is the capital of France?")) == \
        answer.content

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    called = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What is the weather in Paris?")
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert get_weather.invoke(call["args"]).startswith("sunny in ")

    for method in ("json_schema", "function_calling"):  # a response_format; a named tool
        city = llm.with_structured_output(City, method=method).invoke("Name a city in Italy.")
        assert isinstance(city, City) and city.name, method
    as_json = llm.with_structured_output(method="json_mode").invoke(
        "Name a city in Italy, as a JSON object with keys name and country.")
    assert isinstance(as_json, dict)  # json_object: any object, parsed


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_agents_sdk_calls_a_tool_and_returns_a_typed_output(server: Cluster, api: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no network here: traces would go to OpenAI
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
    kind = OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel
    model = kind(model=MODEL, openai_client=client)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sunny in {city}"

    agent = Agent(name="weather", instructions="Answer with the weather tool.", model=model,
                  tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=48))
    typed = Agent(name="cities", instructions="Name a city.", model=model, output_type=City,
                  model_settings=ModelSettings(temperature=0, max_tokens=48))

    async def both() -> tuple[object, object]:  # one loop: the client's pool is bound to it
        weather = await Runner.run(agent, "What is the weather in Paris?")
        city = await Runner.run(typed, "Name a city in Italy.")
        return weather.final_output, city.final_output

    weather, city = asyncio.run(both())
    assert len(asked) == 1 and weather == f"sunny in {asked[0]}"
    assert isinstance(city, City) and city.name


# instructor's JSON mode (a json_object response_format, the schema only in the prompt) is as
# good as the model: the bundled 135M model writes a JSON object of its own shape there.
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_the_pydantic_model(server: Cluster, mode: str) -> None:
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(
        OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0),
        mode=getattr(instructor.Mode, mode),
    )
    ask = [{"role": "user", "content": "Name a city in Italy and its country."}]
    city = client.chat.completions.create(model=MODEL, response_model=City, messages=ask,
                                          temperature=0, max_tokens=128, max_retries=0)
    assert isinstance(city, City) and city.name and city.country
    partials = list(client.chat.completions.create_partial(
        model=MODEL, response_model=City, messages=ask, temperature=0, max_tokens=128,
        max_retries=0))
    assert len(partials) > 1  # streamed: the object grows chunk by chunk
    assert partials[-1].model_dump() == city.model_dump()  # greedy: the same object whole
