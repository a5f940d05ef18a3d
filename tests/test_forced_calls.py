"""tool_choice "required" and a named function on the default model (SmolLM2, whose chat template has no tool
calling), through the official `openai` client against a real `kvd serve`: every answer is a call, of that
function when one is named, with arguments its schema takes; held by the grammar path (doors/forcedcall.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from daemon.models.sources import DEFAULT_MODEL
from daemonproc import DaemonProcess
from test_realmodel import data_dir_with

WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD: Any = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
ASKS = ["What is the weather in Paris?", "What is 2 plus 3?", "Hello!", "Write a poem about the sea."]


def test_a_forced_call_is_always_a_call_and_a_named_one_is_that_function(smollm2: Path, tmp_path: Path) -> None:
    d = DaemonProcess(data_dir_with(smollm2, tmp_path / "kvd"), "--model", DEFAULT_MODEL)
    try:
        api = openai.OpenAI(base_url=d.base_url, api_key=d.token, max_retries=0)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for i, text in enumerate(ASKS):
            forced: list[tuple[Any, str | None]] = [
                ("required", None), ({"type": "function", "function": {"name": "add"}}, "add"),
                ({"type": "function", "function": {"name": "get_weather"}}, "get_weather")]
            for choice, name in forced:
                r = api.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": text}],
                                                tools=TOOLS, tool_choice=choice, max_tokens=96,
                                                temperature=0.8 if i % 2 else 0, seed=i)
                choice_ = r.choices[0]
                assert choice_.finish_reason == "tool_calls", (text, choice, choice_)
                (call,) = choice_.message.tool_calls or []
                assert call.type == "function"
                assert name is None or call.function.name == name
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        stream = api.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": ASKS[0]}],
                                             tools=TOOLS, tool_choice="required", max_tokens=96, temperature=0,
                                             stream=True)
        chunks = [c.choices[0] for c in stream if c.choices]
        assert not "".join(c.delta.content or "" for c in chunks)  # nothing streams as content
        assert [c.finish_reason for c in chunks][-1] == "tool_calls"
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                        tool_choice={"type": "function", "function": {"name": "nope"}})
        assert refused.value.param == "tool_choice.function.name"
    finally:
        assert d.terminate() == 0
    assert "Traceback" not in "".join(d.log)
