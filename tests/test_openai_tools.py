"""Tool calling through the official `openai` client: a model that calls a tool (tests/toolmodel.py),
a real daemon, the call parsed by mlx-lm's parser, the result sent back, the session continued."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import running_daemon
from daemon.doors.toolcalls import StreamSplit, ToolFormat, split
from toolmodel import CALL_TEXT, WEATHER_TOOL, write_alternating_model, write_tool_model

pytestmark = pytest.mark.anyio

TOOLS: list[Any] = [WEATHER_TOOL]
ASK: list[Any] = [{"role": "system", "content": "Use the tools."},
                  {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tool_model(tmp_path_factory.mktemp("tool-model"))


async def test_a_tool_call_round_trip_continues_one_session(tool_model: Path, tmp_path: Path) -> None:
    import openai

    async with running_daemon(tmp_path, model=str(tool_model)) as d:
        base = d.url.replace("ws://", "http://")
        api = openai.AsyncOpenAI(base_url=base, api_key=d.token, max_retries=0)
        raw = await api.chat.completions.with_raw_response.create(
            model=tool_model.name, messages=ASK, tools=TOOLS, max_tokens=20, temperature=0)
        first = raw.parse()
        sid = raw.headers["x-kvd-session"]
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_")
        function: Any = call.function
        assert function.name == "get_weather" and json.loads(function.arguments) == {"city": "Paris"}

        # The client runs the tool and sends its result, with the call as the answer gave it
        # (its arguments re-serialized, as some clients do).
        echoed = choice.message.model_dump(exclude_none=True)
        echoed["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": "Paris"}, separators=(",", ":"))
        convo = [*ASK, echoed, {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
        raw = await api.chat.completions.with_raw_response.create(
            model=tool_model.name, messages=convo, tools=TOOLS, max_tokens=20, temperature=0)
        second = raw.parse()
        assert raw.headers["x-kvd-session"] == sid  # continued, not a new session per round
        assert second.choices[0].finish_reason == "tool_calls"  # the script calls again; a model would answer
        assert second.usage is not None and first.usage is not None
        assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
        assert second.usage.prompt_tokens_details is not None
        assert (second.usage.prompt_tokens_details.cached_tokens or 0) > 0  # the session's cache was reused

        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {d.token}"}) as http:
            transcript = (await http.get(f"kvd/sessions/{sid}")).json()
        await api.close()
    roles = [m["role"] for m in transcript["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    kept = transcript["messages"][2]
    assert kept["content"] == "" and kept["tool_calls"][0]["id"] == call.id
    assert kept["tool_calls"][0]["function"]["name"] == "get_weather"
    assert transcript["messages"][3] == {"role": "tool", "content": "18 C and sunny", "tool_call_id": call.id}


async def test_a_streamed_tool_call_and_tool_choice_none(tool_model: Path, tmp_path: Path) -> None:
    import openai

    async with running_daemon(tmp_path, model=str(tool_model)) as d:
        api = openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token, max_retries=0)
        stream = await api.chat.completions.create(model=tool_model.name, messages=ASK, tools=TOOLS,
                                                   max_tokens=20, temperature=0, stream=True)
        content, calls, reasons = "", [], []  # type: tuple[str, list[Any], list[str]]
        async for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            calls += delta.tool_calls or []
            reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
        # "none": the tools are not offered and nothing is parsed: the model's text is the content.
        plain = await api.chat.completions.create(model=tool_model.name, messages=ASK, tools=TOOLS,
                                                  tool_choice="none", max_tokens=20, temperature=0)
        await api.close()
    assert content == "" and reasons == ["tool_calls"]
    (call,) = calls
    assert call.index == 0 and call.id and call.function is not None and call.function.name == "get_weather"
    assert json.loads(call.function.arguments or "") == {"city": "Paris"}
    assert plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.content == CALL_TEXT and not plain.choices[0].message.tool_calls


def test_calls_are_split_from_the_text_in_the_models_own_format(tool_model: Path) -> None:
    from mlx_lm.utils import load

    tokenizer = load(str(tool_model))[1]
    fmt = ToolFormat.of(tokenizer, [WEATHER_TOOL])
    assert fmt is not None
    assert ToolFormat.of(tokenizer, None) is None
    text = f"Let me look.\n{CALL_TEXT}\n{CALL_TEXT}"
    content, calls = split(fmt, text)
    assert content == "Let me look." and [c["name"] for c in calls] == ["get_weather", "get_weather"]
    assert calls[0]["id"] != calls[1]["id"]
    # A call cut short (max_tokens) or not JSON stays in the text: nothing generated is dropped.
    cut = "Sure. <tool_call>\n{\"name\": \"get_wea"
    assert split(fmt, cut) == (cut, [])
    # Streamed: text before a call streams, a marker split across deltas is held until it is known.
    stream = StreamSplit(fmt)
    shown = [stream.feed(piece) for piece in ["Let me ", "look. <tool", "_call>\n{\"name\": ", "\"get_weather\", ",
                                              "\"arguments\": {}}\n</tool_call>"]]
    assert shown == ["Let me ", "look. ", "", "", ""]
    rest, calls = stream.finish()
    assert rest == "" and [(c["name"], c["arguments"]) for c in calls] == [("get_weather", "{}")]
    # The turn core keeps what `split` makes of the whole text, from the one parse `finish` made.
    whole = "Let me look. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>"
    assert stream.content == split(fmt, whole)[0] == "Let me look."
    stream = StreamSplit(fmt)
    assert stream.feed("a <tool") == "a " and stream.feed("box> b") == "<toolbox> b"
    assert stream.finish() == ("", [])


async def test_a_conversation_the_chat_template_refuses_is_a_400_that_stores_nothing(
        tool_model: Path, tmp_path: Path) -> None:
    """A template that raises (roles that do not alternate, on a Gemma- or Mistral-like template) is the
    client's conversation refused: a 400 quoting the template, nothing stored, and kvd serves on. It was a
    500 ("the prompt could not be tokenized") with a traceback in the log, and the answer kept as an error."""
    import openai

    strict = write_alternating_model(tool_model, tmp_path)
    twice: list[Any] = [{"role": "user", "content": "Hi."}, {"role": "user", "content": "Hi again."}]
    async with running_daemon(tmp_path / "kvd", model=str(strict)) as d:
        api = openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token, max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            await api.chat.completions.create(model=strict.name, messages=twice, max_tokens=2)
        answered = await api.chat.completions.create(model=strict.name, messages=twice[:1], max_tokens=2)
        kept = await api.chat.completions.create(
            model=strict.name, max_tokens=2,
            messages=[*twice[:1], {"role": "assistant", "content": answered.choices[0].message.content or ""},
                      {"role": "user", "content": "And?"}])
        with pytest.raises(openai.BadRequestError):  # a session it continues is left as it was
            await api.chat.completions.create(
                model=strict.name, max_tokens=2,
                messages=[*twice[:1], {"role": "assistant", "content": answered.choices[0].message.content or ""},
                          {"role": "user", "content": "And?"}, {"role": "user", "content": "Well?"}])
        await api.close()
        sessions = d.store.list_sessions()
        transcript = d.store.messages(sessions[0]["id"])
    error: Any = refused.value.body
    assert "roles must alternate" in error["message"] and "chat template" in error["message"], error
    assert kept.choices[0].finish_reason in ("stop", "length")
    assert len(sessions) == 1, sessions  # only the conversation the template took
    assert [m["role"] for m in transcript] == ["user", "assistant", "user", "assistant"], transcript
    assert all(m["status"] == "complete" for m in transcript), transcript
