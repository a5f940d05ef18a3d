"""The official `anthropic` client against a real `kvd serve`: messages.create and messages.stream, a tool
round trip, count_tokens, the model names it answers to, and a conversation's cache across a restart."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from daemonproc import DaemonProcess
from toolmodel import WEATHER_TOOL, write_plain_model, write_tool_model

MODEL = "builtin:tiny"
# The client has no temperature argument any more (Anthropic's newest models take none); the API still does.
GREEDY: dict[str, Any] = {"max_tokens": 16, "extra_body": {"temperature": 0}}
FUNCTION: Any = WEATHER_TOOL["function"]
TOOLS: list[Any] = [{"name": FUNCTION["name"], "description": FUNCTION["description"],
                     "input_schema": FUNCTION["parameters"]}]


def client(d: DaemonProcess, **kw: Any) -> anthropic.Anthropic:
    """Anthropic's client as a user points it at kvd: the daemon's root, its token as the API key."""
    return anthropic.Anthropic(base_url=d.base_url.removesuffix("/v1"), api_key=d.token, max_retries=0, **kw)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    root = tmp_path_factory.mktemp("kvd")
    config = root / "kvd.toml"
    # Prefill in small chunks: a prompt of a few hundred tokens is read in several, with progress between.
    config.write_text('[cache]\nprefetch = false\n[generation]\nprefill_step_size = 64\n'
                      '[api]\nmodel_aliases = ["claude-haiku-4-5"]\n')
    d = DaemonProcess(root / "data", "--model", MODEL, "--config", str(config))
    with d.client():
        pass  # the model has loaded
    yield d
    assert d.terminate() == 0
    assert "Traceback" not in "".join(d.log)


def test_create_and_stream_answer(daemon: DaemonProcess) -> None:
    api = client(daemon)
    ask: list[Any] = [{"role": "user", "content": "Say something."}]
    made = api.messages.create(model=MODEL, system="Be brief.", messages=ask, **GREEDY)
    assert made.type == "message" and made.role == "assistant" and made.model == MODEL
    assert made.stop_reason in ("end_turn", "max_tokens") and made.content[0].type == "text"
    assert made.usage.output_tokens >= 1 and made.usage.input_tokens > 0

    names: list[str] = []
    started: Any = None
    with api.messages.stream(model=MODEL, system="Be brief.", messages=ask, **GREEDY) as stream:
        for event in stream:
            names.append(event.type)
            if event.type == "message_start":
                started = event.message.usage
        streamed = stream.get_final_message()
    assert names[0] == "message_start" and names[-1] == "message_stop" and "content_block_delta" in names
    assert streamed.content[0].type == "text" and made.content[0].type == "text"
    assert streamed.content[0].text == made.content[0].text  # greedy: the same answer
    assert streamed.stop_reason == made.stop_reason and streamed.usage.output_tokens == made.usage.output_tokens
    # The same conversation again: placed on the session that holds it, its prompt restored, not prefilled.
    total = streamed.usage.input_tokens + (streamed.usage.cache_read_input_tokens or 0)
    assert total == made.usage.input_tokens + (made.usage.cache_read_input_tokens or 0)
    assert (streamed.usage.cache_read_input_tokens or 0) > 0
    # message_start already says what the prompt cost, as Anthropic's does (it said 0 and 0: clients that
    # count a conversation's tokens from it, as Claude Code does, saw an empty prompt).
    assert (started.input_tokens, started.cache_read_input_tokens) == (
        streamed.usage.input_tokens, streamed.usage.cache_read_input_tokens), started


def test_a_stop_sequence_says_which(daemon: DaemonProcess) -> None:
    api = client(daemon)
    ask: list[Any] = [{"role": "user", "content": "Count."}]
    free = api.messages.create(model=MODEL, messages=ask, **GREEDY)
    assert free.content[0].type == "text"
    word = free.content[0].text.split()[1]  # a word the greedy answer writes after its first
    stopped = api.messages.create(model=MODEL, messages=ask, stop_sequences=["\x00", word], **GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].type == "text" and word not in stopped.content[0].text


def test_count_tokens_is_what_the_answer_reads(daemon: DaemonProcess) -> None:
    api = client(daemon)
    ask: list[Any] = [{"role": "user", "content": "How many tokens is this?"}]
    counted = api.messages.count_tokens(model=MODEL, system="Count them.", messages=ask)
    made = api.messages.create(model=MODEL, system="Count them.", messages=ask, **GREEDY)
    assert counted.input_tokens == made.usage.input_tokens + (made.usage.cache_read_input_tokens or 0)


def test_the_token_as_bearer_and_the_model_names_it_answers_to(daemon: DaemonProcess) -> None:
    ask: list[Any] = [{"role": "user", "content": "hi"}]
    bearer = anthropic.Anthropic(base_url=daemon.base_url.removesuffix("/v1"), auth_token=daemon.token,
                                 max_retries=0, default_headers={"anthropic-beta": "fine-grained-tool-streaming"})
    assert bearer.messages.create(model="claude-haiku-4-5", messages=ask, max_tokens=2).model == MODEL
    with pytest.raises(anthropic.NotFoundError) as caught:
        bearer.messages.create(model="claude-opus-4-1", messages=ask, max_tokens=2)
    assert "model_aliases" in caught.value.message and MODEL in caught.value.message
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=daemon.base_url.removesuffix("/v1"), api_key="wrong",
                            max_retries=0).messages.create(model=MODEL, messages=ask, max_tokens=2)
    body: Any = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"


def test_a_conversation_past_the_context_is_a_400_naming_a_bigger_model(daemon: DaemonProcess) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(daemon).messages.create(model=MODEL, max_tokens=20_000,  # lowered to limits.max_tokens_limit
                                       messages=[{"role": "user", "content": "x " * 9_000}])
    message = caught.value.message
    assert "context of 8192 tokens" in message and "builtin:gemma3" in message, message


def test_a_max_tokens_past_the_limit_is_as_much_as_the_context_leaves(daemon: DaemonProcess) -> None:
    """Claude Code asks for 32k-64k tokens: lowered to limits.max_tokens_limit (4096), which beside a 4.5k-token
    conversation no longer fits an 8k context. It was refused ("plus max_tokens (4096) exceeds"); the answer now
    gets the room the context leaves."""
    ask: list[Any] = [{"role": "user", "content": "x " * 2_200}]  # ~4.4k tokens
    with client(daemon).messages.stream(model=MODEL, max_tokens=64_000, messages=ask, stop_sequences=[" "],
                                        extra_body={"temperature": 0}) as stream:  # the SDK streams a 64k ask
        made = stream.get_final_message()
    prompt = made.usage.input_tokens + (made.usage.cache_read_input_tokens or 0)
    assert 4_096 + prompt > 8_192, prompt  # it would not have fitted as asked
    assert made.stop_reason in ("stop_sequence", "end_turn", "max_tokens"), made
    assert made.usage.output_tokens <= 8_192 - prompt


def test_a_conversation_continued_after_a_restart_reads_its_cache(tmp_path: Path) -> None:
    system = "You answer questions about this manual.\n" + "\n".join(
        f"Section {i}: the setting number {i} does exactly what its name says." for i in range(60))
    convo: list[Any] = [{"role": "user", "content": "What does setting 7 do?"}]
    d = DaemonProcess(tmp_path, "--model", MODEL)
    try:
        for follow_up in ("And setting 8?", "And setting 9?"):
            made = client(d).messages.create(model=MODEL, system=system, messages=convo, **GREEDY)
            convo += [{"role": "assistant", "content": [b.model_dump() for b in made.content]},
                      {"role": "user", "content": follow_up}]
    finally:
        assert d.terminate() == 0
    d = DaemonProcess(tmp_path, "--model", MODEL)
    try:
        raw = client(d).messages.with_raw_response.create(model=MODEL, system=system, messages=convo, **GREEDY)
        again = raw.parse()
        with d.client() as c:
            sessions = c.request("session.list")["sessions"]
    finally:
        assert d.terminate() == 0
    usage = again.usage
    read = usage.cache_read_input_tokens or 0
    print(f"after a restart: {read} of {usage.input_tokens + read} prompt tokens restored")  # pytest -s shows it
    assert read >= 0.9 * (usage.input_tokens + read), usage  # restored from disk, not prefilled
    assert [s["id"] for s in sessions] == [raw.headers["x-kvd-session"]]  # one conversation, one session


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tool_model(tmp_path_factory.mktemp("tool-model"))


@pytest.fixture(scope="module")
def tool_daemon(tool_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("kvd-tools"), "--model", str(tool_model))
    with d.client():
        pass
    yield d
    assert d.terminate() == 0


def test_a_tool_round_trip(tool_daemon: DaemonProcess) -> None:
    api = client(tool_daemon)
    model = "tool-caller"
    ask: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    raw = api.messages.with_raw_response.create(model=model, system="Use the tools.", messages=ask, tools=TOOLS,
                                                max_tokens=20, extra_body={"temperature": 0})
    first = raw.parse()
    session = raw.headers["x-kvd-session"]
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}

    convo: list[Any] = [*ask, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                      "content": [{"type": "text", "text": "18 C and sunny"}]}]}]
    with api.messages.stream(model=model, system="Use the tools.", messages=convo, tools=TOOLS, max_tokens=20,
                             extra_body={"temperature": 0}) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        second = stream.get_final_message()
    assert ("content_block_delta", "input_json_delta") in kinds
    assert second.stop_reason == "tool_use"  # the script calls again; a model would answer
    (again,) = second.content
    assert again.type == "tool_use" and again.input == {"city": "Paris"} and again.id != call.id
    assert (second.usage.cache_read_input_tokens or 0) > 0  # the session's cache was reused

    with httpx.Client(base_url=tool_daemon.base_url, headers={"x-api-key": tool_daemon.token}) as http:
        kept = http.get(f"kvd/sessions/{session}").json()["messages"]
    assert [m["role"] for m in kept] == ["system", "user", "assistant", "tool", "assistant"]  # one session
    assert kept[2]["tool_calls"][0]["id"] == call.id and json.loads(
        kept[2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert kept[3] == {"role": "tool", "content": "18 C and sunny", "tool_call_id": call.id}

    plain = api.messages.create(model=model, messages=ask, tools=TOOLS, tool_choice={"type": "none"},
                                max_tokens=20, extra_body={"temperature": 0})
    assert plain.stop_reason == "end_turn" and plain.content[0].type == "text"  # not offered: its text is text


def test_structured_output_holds_the_answer_to_its_schema(daemon: DaemonProcess) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    made = client(daemon).messages.create(
        model=MODEL, messages=[{"role": "user", "content": "A number, as JSON."}], max_tokens=40,
        output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body={"temperature": 0})
    assert made.content[0].type == "text"
    if made.stop_reason == "end_turn":
        assert set(json.loads(made.content[0].text)) == {"n"}
    else:
        assert made.content[0].text.startswith("{")


def test_a_long_prompt_is_pinged_while_it_is_read(daemon: DaemonProcess) -> None:
    """The stream opens once the engine has taken the prompt (it was admitted and fits), its message_start
    saying what the prompt is, and pings until the first token, so that no client times out while kvd reads."""
    long = "Read this first. " + " ".join(f"item {i}" for i in range(400))
    names: list[str] = []
    with httpx.stream("POST", f"{daemon.base_url.removesuffix('/v1')}/v1/messages", timeout=60,
                      headers={"x-api-key": daemon.token, "anthropic-version": "2023-06-01"},
                      json={"model": MODEL, "max_tokens": 4, "stream": True,
                            "messages": [{"role": "user", "content": long}]}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    first_block = names.index("content_block_start")
    assert names[0] == "message_start" and "ping" in names[:first_block], names
    started = json.loads(lines[1].removeprefix("data: "))["message"]["usage"]  # the prompt's, before it is read
    assert started["input_tokens"] + started["cache_read_input_tokens"] > 400, started
    assert names[-2:] == ["message_delta", "message_stop"] and "ping" not in names[first_block:]


def test_tools_offered_to_a_model_that_cannot_call_them_are_left_out(tool_model: Path, tmp_path: Path) -> None:
    """An agent offers its tools with every request; a model without tool calling answers without them (as
    every door does: test_door_rules.py), and count_tokens counts what the answer read."""
    plain = write_plain_model(tool_model, tmp_path)
    d = DaemonProcess(tmp_path / "kvd", "--model", str(plain))
    try:
        ask: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
        made = client(d).messages.create(model="kvd", messages=ask, tools=TOOLS, max_tokens=20,
                                         extra_body={"temperature": 0})
        counted = client(d).messages.count_tokens(model="kvd", messages=ask, tools=TOOLS)
    finally:
        assert d.terminate() == 0
    assert made.stop_reason == "end_turn" and made.content[0].type == "text"  # the call's text is only text
    assert counted.input_tokens == made.usage.input_tokens + (made.usage.cache_read_input_tokens or 0)
    assert "calls no tools: answering a messages request that offered 1 without them" in (
        d.data_dir / "kvd.log").read_text()
