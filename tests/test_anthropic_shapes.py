"""The Anthropic Messages door's pure parts: a request read as kvd's conversation, its refusals, the
model names it answers to, and a turn's typed events encoded as Anthropic's body and server-sent events."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

import pytest

from daemon.config import Config, ConfigError, load_config
from daemon.doors.anthropic_events import MessageStream, sse, usage_of, whole
from daemon.doors.anthropic_schema import conversation, error_body, parse
from daemon.doors.guards import check
from daemon.doors.httpdoor import ApiError
from daemon.doors.openai_schema import answers_to
from daemon.doors.placement import Said
from daemon.events import (
    AnswerDelta,
    AnswerDone,
    AnswerProgress,
    AnswerReading,
    AnswerStarted,
    AnswerToolCall,
    TurnEvent,
)

CONFIG = Config(model="builtin:tiny")
USER = {"role": "user", "content": "hi"}
ASK: dict[str, Any] = {"model": "builtin:tiny", "max_tokens": 8, "messages": [USER]}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
WEATHER = {"name": "get_weather", "description": "The weather.", "input_schema": {"type": "object"}}


def refused(body: Any, config: Config = CONFIG, **kw: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        conversation(parse(body, config, **kw))
    return caught.value


def test_a_conversation_with_tools_reads_as_the_transcript_keeps_it() -> None:
    req = parse({**ASK, "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                                   {"type": "text", "text": "Use tools."}],
                 "tools": [WEATHER], "messages": [
                     {"role": "user", "content": [{"type": "text", "text": "Weather"},
                                                  {"type": "text", "text": "in Paris?"}]},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                       {"type": "text", "text": "Looking."}, CALL]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                         {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                          "content": [{"type": "text", "text": "timeout"}]},
                         {"type": "text", "text": "and?"}]}]}, CONFIG)
    assert req.instructions() == "Be brief.\n\nUse tools."
    assert req.offered_tools() == [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"}, "description": "The weather."}}]
    assert conversation(req) == [
        Said("user", "Weather\nin Paris?"),
        Said("assistant", "Looking.", ({"id": "toolu_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},)),
        Said("tool", "18 C", tool_call_id="toolu_1"),
        Said("tool", "Error: timeout", tool_call_id="toolu_1"),
        Said("user", "and?"),
    ]


def test_a_system_message_in_the_conversation_is_text_in_the_users_turn() -> None:
    """Claude Code's mid-conversation system messages: one user turn, as chat templates want turns to alternate,
    the system text first and the user's words last (where the default model answers them)."""
    req = parse({**ASK, "messages": [USER, {"role": "system", "content": [{"type": "text", "text": "Agents: x"}]},
                                     {"role": "assistant", "content": "Hello."},
                                     {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go"}]},
                CONFIG)
    assert conversation(req) == [Said("user", "Agents: x\n\nhi"), Said("assistant", "Hello."),
                                 Said("user", "Be brief.\n\nGo")]


def test_tool_choice_none_offers_no_tools_and_auto_offers_them() -> None:
    for choice, offered in (("none", False), ("auto", True)):
        req = parse({**ASK, "tools": [WEATHER], "tool_choice": {"type": choice}}, CONFIG)
        assert (req.offered_tools() is not None) == offered
    # A server tool (not kvd's to run) is accepted and not shown, as the Responses door's other kinds.
    server = {"type": "web_search_20250305", "name": "web_search"}
    assert parse({**ASK, "tools": [server, WEATHER]}, CONFIG).offered_tools() == parse(
        {**ASK, "tools": [WEATHER]}, CONFIG).offered_tools()
    assert parse({**ASK, "tools": [server]}, CONFIG).offered_tools() is None


REFUSALS: list[tuple[str, Any, str, str]] = [
    ("no max_tokens", {"messages": [USER]}, "max_tokens", "Field required"),
    ("an image", {**ASK, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]}]},
     "messages[0].content[0]", "kvd serves text models"),
    ("a document in a tool result", {**ASK, "messages": [
        {"role": "assistant", "content": [CALL]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "document", "source": {}}]}]}]}, "messages[1].content[0].content[0]", "'document' content"),
    ("an unknown block", {**ASK, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
     "messages[0].content[0]", "which kvd does not take"),
    ("a stray tool result", {**ASK, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id", "answers no tool_use"),
    ("a result for another call", {**ASK, "messages": [
        USER, {"role": "assistant", "content": [CALL]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]}]},
     "messages[2].content[0].tool_use_id", "its calls: toolu_1"),
    ("a tool_use from the user", {**ASK, "messages": [{"role": "user", "content": [CALL]}]},
     "messages[0].content[0]", "only assistant messages"),
    ("an assistant message last", {**ASK, "messages": [USER, {"role": "assistant", "content": "Sure"}]},
     "messages[1]", "does not continue a partial answer"),
    ("a tool_result in a system message", {**ASK, "messages": [
        USER, {"role": "assistant", "content": [CALL]},
        {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]},
     "messages[2].content[0]", "only user messages"),
    ("a string max_tokens", {**ASK, "max_tokens": "8"}, "max_tokens", ""),
    ("a surrogate", json.loads('{"max_tokens": 8, "messages": [{"role": "user", "content": "a\\ud800"}]}'),
     "messages[0].content", "surrogate"),
    ("five stop sequences", {**ASK, "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences", ""),
    ("a custom tool without its schema", {**ASK, "tools": [{"name": "f"}]}, "tools[0].input_schema", "no input_schema"),
    ("tool_choice without tools", {**ASK, "tool_choice": {"type": "any"}}, "tool_choice", "no tools"),
    ("tool_choice naming no tool", {**ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}},
     "tool_choice.name", "not among tools"),
    ("a forced tool with an output format", {**ASK, "tools": [WEATHER], "tool_choice": {"type": "any"},
                                               "output_config": {"format": {"type": "json_schema", "schema": {
                                                   "type": "object"}}}}, "output_config.format", "JSON already"),
    ("not an object", [ASK], "", "JSON object"),
]


@pytest.mark.parametrize("case, body, param, says", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_each_refusal_names_its_field(case: str, body: Any, param: str, says: str) -> None:
    e = refused(body)
    assert e.status in (HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND), case
    assert (e.param or "").startswith(param) and says in e.message, (case, e.param, e.message)
    shaped = error_body(e)
    assert shaped["type"] == "error" and shaped["error"]["message"] == e.message
    kind = "not_found_error" if e.status == HTTPStatus.NOT_FOUND else "invalid_request_error"
    assert shaped["error"]["type"] == kind


def test_max_tokens_past_the_limit_is_accepted_for_the_door_to_lower() -> None:
    assert parse({**ASK, "max_tokens": 64_000}, CONFIG).max_tokens == 64_000
    assert parse({"messages": [USER]}, CONFIG, count=True).max_tokens == 1  # count_tokens needs none


def test_model_aliases_a_list_or_every_name(tmp_path: Any) -> None:
    """Which names the default model answers to beyond those kvd can serve (the registry's, ApiTurns.model)."""
    assert not answers_to("claude-haiku-4-5", CONFIG)
    listed = Config(model="builtin:tiny", model_aliases=("claude-haiku-4-5",))
    assert answers_to("claude-haiku-4-5", listed) and not answers_to("claude-opus-4", listed)
    assert answers_to("anything at all", Config(model_aliases=("*",)))
    path = tmp_path / "kvd.toml"
    path.write_text('[api]\nmodel_aliases = "*"\n')
    assert load_config(path).model_aliases == ("*",)
    path.write_text('[api]\nmodel_aliases = "claude"\n')
    with pytest.raises(ConfigError, match='or "\\*" for every name'):
        load_config(path)


def test_the_token_as_x_api_key_or_bearer() -> None:
    base = {"host": "127.0.0.1:8765"}
    assert check({**base, "x-api-key": "t0k"}, CONFIG, "t0k") is None
    assert check({**base, "authorization": "Bearer t0k"}, CONFIG, "t0k") is None
    refusal = check({**base, "x-api-key": "wrong"}, CONFIG, "t0k")
    assert refusal is not None and refusal.status == 401


DONE = AnswerDone(3, "stop", {"prompt_tokens": 100, "cached_tokens": 90, "completion_tokens": 7,
                               "restored_from": "disk", "shared_tokens": 0, "ttft_ms": 12.5, "prefill_tokens": 10})


def test_usage_in_anthropics_terms() -> None:
    assert usage_of(DONE.usage) == {"input_tokens": 10, "cache_creation_input_tokens": 0,
                                    "cache_read_input_tokens": 90, "output_tokens": 7}


def test_a_whole_answer_with_a_call() -> None:
    call = AnswerToolCall(0, "call_1", "get_weather", '{"city": "Paris"}')
    body = whole("msg_1", "builtin:tiny", AnswerDone(3, "stop", DONE.usage, "Let me look.", (call,)))
    assert body["content"] == [{"type": "text", "text": "Let me look."},
                               {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("tool_use", None)
    assert whole("m", "x", DONE, "END")["stop_reason"] == "stop_sequence"
    assert whole("m", "x", AnswerDone(3, "length", {}))["stop_reason"] == "max_tokens"
    assert whole("m", "x", AnswerDone(3, "cancelled", {}))["stop_reason"] == "max_tokens"  # cut: not whole
    assert whole("m", "x", DONE)["content"] == [{"type": "text", "text": ""}]
    kvd = whole("m", "x", DONE)["kvd"]  # what the cache did, as every HTTP door reports it
    assert (kvd["restored_from"], kvd["prefill_tokens"], kvd["ttft_ms"]) == ("disk", 10, 12.5), kvd


def test_a_streamed_answer_in_anthropics_order() -> None:
    stream = MessageStream("msg_1", "builtin:tiny")
    events: list[TurnEvent] = [
        AnswerStarted(3), AnswerReading(100, 90), AnswerProgress(512, 4096),
        AnswerDelta(0, "Let "), AnswerDelta(1, "me."),
        AnswerToolCall(0, "call_1", "f", "{}"), AnswerToolCall(1, "call_2", "g", '{"a": 1}'),
        AnswerDone(3, "stop", DONE.usage, "Let me.", ())]
    out = [e for event in events for e in stream.feed(event)]
    assert [name for name, _ in out] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    starts = [data["content_block"] for name, data in out if name == "content_block_start"]
    assert starts[1] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}
    assert [data["index"] for name, data in out if name.startswith("content_block")] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert out[7][1]["delta"] == {"type": "input_json_delta", "partial_json": "{}"}
    assert out[-2][1]["usage"]["cache_read_input_tokens"] == 90
    # message_start says what the prompt costs, as Anthropic's does: known once the engine has taken it.
    assert out[0][1]["message"]["usage"] == {"input_tokens": 10, "cache_creation_input_tokens": 0,
                                             "cache_read_input_tokens": 90, "output_tokens": 0}
    assert out[-2][1]["kvd"]["restored_from"] == "disk"  # in a stream too
    assert sse(out[-1]) == b'event: message_stop\ndata: {"type": "message_stop"}\n\n'


def test_an_empty_streamed_answer_still_has_a_text_block() -> None:
    stream = MessageStream("m", "x")
    out = stream.feed(DONE, "STOP")
    assert [name for name, _ in out] == [
        "message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    assert out[0][1]["message"]["usage"]["cache_read_input_tokens"] == 90  # the usage's, when it begins at the end
