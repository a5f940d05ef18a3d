"""Tool messages checked as OpenAI checks them (issue 35): a tool result answers a call of the assistant
message it follows, and a call's arguments are JSON text; otherwise a 400 that stores nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from conftest import running_daemon

pytestmark = pytest.mark.anyio

CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
ASK = {"role": "user", "content": "Weather in Paris?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [CALL]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}

REFUSED: list[tuple[str, list[dict[str, Any]], str, str]] = [
    ("a result for a call never made", [ASK, CALLED, {**RESULT, "tool_call_id": "call_9"}],
     "answers no call", "messages[2].tool_call_id"),
    ("a result after a user message", [ASK, {**RESULT}], "not an assistant message with tool_calls",
     "messages[1].role"),
    ("a result after an answer without calls", [ASK, {"role": "assistant", "content": "hm"}, RESULT],
     "not an assistant message with tool_calls", "messages[2].role"),
    ("a result for an earlier assistant's call", [ASK, CALLED, RESULT, {"role": "assistant", "content": "ok"},
                                                  {"role": "user", "content": "and?"}, RESULT],
     "not an assistant message with tool_calls", "messages[5].role"),
    ("made-up arguments", [ASK, {**CALLED, "tool_calls": [{**CALL, "function": {
        "name": "weather", "arguments": "city=Paris"}}]}, RESULT],
     "is not JSON text", "messages[1].tool_calls[0].function.arguments"),
    ("arguments nested 100,000 deep", [ASK, {**CALLED, "tool_calls": [{**CALL, "function": {
        "name": "weather", "arguments": "[" * 100_000}}]}, RESULT],
     "is not JSON text", "messages[1].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("case, messages, says, param", REFUSED, ids=[r[0] for r in REFUSED])
async def test_a_tool_message_openai_refuses_is_a_400_that_stores_nothing(
        tmp_path: Path, case: str, messages: list[dict[str, Any]], says: str, param: str) -> None:
    async with running_daemon(tmp_path) as d:
        api = openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            await api.chat.completions.create(model="builtin:tiny", messages=messages,  # type: ignore[arg-type]
                                              max_tokens=2)
        assert says in e.value.message and e.value.param == param, (e.value.message, e.value.param)
        # The round trip OpenAI accepts, two results for two calls included, is still answered.
        two = {**CALLED, "tool_calls": [CALL, {**CALL, "id": "call_2"}]}
        accepted: Any = [ASK, two, RESULT, {**RESULT, "tool_call_id": "call_2"}]
        ok = await api.chat.completions.create(model="builtin:tiny", max_tokens=2, messages=accepted)
        await api.close()
        assert ok.choices[0].finish_reason in ("stop", "length")
        assert len(d.store.list_sessions()) == 1  # the accepted one only
