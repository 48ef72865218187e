"""A conversation that makes the bundled model answer with a Hermes-format tool call.

The bundled SmolLM2 template ignores ``tools``, so earlier turns show the format; greedy
decoding then calls ``get_weather`` for the last city, deterministically."""

from __future__ import annotations

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def few_shot_tool_calls(city: str) -> list[dict]:
    shot = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
    system = 'To call a tool, reply with <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>'
    messages = [{"role": "system", "content": system}]
    for past in ("Rome", "Oslo"):
        messages.append({"role": "user", "content": f"Weather in {past}?"})
        messages.append({"role": "assistant", "content": shot % past})
    return messages + [{"role": "user", "content": f"Weather in {city}?"}]


# Arguments the model would not write unconstrained: the grammar mask decides them.
FORECAST_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Lisboa, Portugal", "Porto, Portugal"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}


def forecast_tool(responses: bool = False) -> dict:
    """``get_forecast`` with ``FORECAST_PARAMETERS``: in chat's shape, or the Responses API's
    (flat: no ``function`` object)."""
    function = {"name": "get_forecast", "parameters": FORECAST_PARAMETERS}
    return (
        {"type": "function", **function}
        if responses
        else {"type": "function", "function": function}
    )
