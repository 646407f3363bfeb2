"""A two-tool agent loop of the OpenAI Agents SDK (``openai-agents``, unmodified) against a running
server with no flags: over chat completions and over Responses, streamed and not.

    python -m venv /tmp/agents && /tmp/agents/bin/pip install openai-agents
    duoserve serve --port 8000 &
    /tmp/agents/bin/python tests/conformance/agents_loop.py http://127.0.0.1:8000/v1 [MODEL] [--runs N]

Each run asks a question that needs a tool; the SDK sends ``tools`` (and no ``tool_choice``,
which is ``auto``), runs the calls the model makes and sends their outputs back, until the model
answers in text or ``max_turns`` ends the loop. A run passes when every call the SDK received
parsed (a known tool, arguments its schema accepts: the SDK raises otherwise) and the loop ended
one of those two ways; the model's answer is not judged. Not run by CI: the SDK pulls in MCP and
its web stack, which the server's own tests do not need.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

QUESTIONS = ["What is the weather in Paris?", "What time is it in Tokyo?",
             "Tell me the weather and the time in Lisbon."]


async def one_run(agents, model, question: str, streamed: bool, max_turns: int) -> dict:
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(f"get_weather({city!r})")
        return f"sunny and 21 C in {city}"

    @agents.function_tool
    def get_time(city: str) -> str:
        """The current local time in a city."""
        calls.append(f"get_time({city!r})")
        return f"14:05 in {city}"

    agent = agents.Agent(name="assistant", instructions="Use the tools to answer.", model=model,
                         tools=[get_weather, get_time])
    try:
        if streamed:
            result = agents.Runner.run_streamed(agent, question, max_turns=max_turns)
            async for _ in result.stream_events():
                pass
        else:
            result = await agents.Runner.run(agent, question, max_turns=max_turns)
        ended = "answer"
        output = str(result.final_output)
    except agents.exceptions.MaxTurnsExceeded:
        ended, output = "max_turns", ""
    except Exception as exc:   # a call that did not parse, an API error: the run fails
        return {"question": question, "streamed": streamed, "calls": calls, "ended": "error",
                "error": f"{type(exc).__name__}: {exc}"}
    return {"question": question, "streamed": streamed, "calls": calls, "ended": ended, "output": output[:80]}


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url")
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--runs", type=int, default=1, help="times each question is asked per API and mode")
    parser.add_argument("--max-turns", type=int, default=4)
    args = parser.parse_args()

    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)   # traces would go to OpenAI's servers
    client = AsyncOpenAI(base_url=args.base_url, api_key="none")
    apis = {"chat": agents.OpenAIChatCompletionsModel(model=args.model, openai_client=client),
            "responses": agents.OpenAIResponsesModel(model=args.model, openai_client=client)}
    results = []
    for api, model in apis.items():
        for streamed in (False, True):
            for question in QUESTIONS * args.runs:
                run = await one_run(agents, model, question, streamed, args.max_turns)
                results.append({"api": api, **run})
                print(json.dumps(results[-1]), flush=True)
    failed = [r for r in results if r["ended"] == "error"]
    with_calls = sum(1 for r in results if r["calls"])
    answered = sum(1 for r in results if r["ended"] == "answer")
    print(f"{len(results)} runs: {len(results) - len(failed)} ended (answer {answered}, max_turns "
          f"{len(results) - len(failed) - answered}), {len(failed)} failed; {with_calls} made tool calls")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
