"""The Responses door's pure parts: the request and its input as a conversation, the stream's events in
OpenAI's order, and the stored responses (a real SQLite store, migrated)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from daemon.config import Config
from daemon.doors.httpdoor import ApiError
from daemon.doors.placement import Said
from daemon.doors.responses_events import Encoder, ResponseShape, output_of
from daemon.doors.responses_schema import conversation, parse
from daemon.doors.responses_stored import input_items, stored_object
from daemon.events import AnswerDelta, AnswerDone, AnswerError, AnswerProgress, AnswerStarted, AnswerToolCall
from sessions import Store
from sessions.responses import StoredResponse, delete_response, get_response, put_response

CONFIG = Config()


def req(**fields: Any) -> Any:
    return parse({"model": "kvd", "input": "hi", **fields}, CONFIG)


def refusal(body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, CONFIG)
    return info.value


def call(call_id: str = "c1", name: str = "f", arguments: str = "{}") -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


# --- the request ---


def test_a_string_input_is_one_user_message() -> None:
    new = conversation(req().input)
    assert new.messages == (Said("user", "hi"),) and new.lead == ()


def test_items_become_the_messages_the_transcript_keeps() -> None:
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                              {"type": "input_text", "text": "b"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "thinking"}]},
             {"type": "reasoning", "summary": []},
             call("c1", "f", '{"x": 1}'), call("c2", "g"),
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
             {"role": "user", "content": "and?"}]
    new = conversation(req(input=items).input)
    assert new.lead == ("Be brief.",)
    calls = ({"id": "c1", "name": "f", "arguments": '{"x": 1}'}, {"id": "c2", "name": "g", "arguments": "{}"})
    assert new.messages == (Said("user", "ab"), Said("assistant", "thinking", calls), Said("tool", "one", (), "c1"),
                            Said("tool", "two", (), "c2"), Said("user", "and?"))
    assert new.starts == (1, 2, 6, 7, 8)


def test_a_call_alone_is_an_answer_with_no_text_and_an_output_may_answer_the_previous_response() -> None:
    new = conversation(req(input=[call()]).input)
    assert new.messages == (Said("assistant", "", ({"id": "c1", "name": "f", "arguments": "{}"},)),)
    answered = conversation(req(input=[{"type": "function_call_output", "call_id": "c9", "output": "x"}]).input,
                            {"c9"})
    assert answered.messages == (Said("tool", "x", (), "c9"),)


BAD: list[tuple[str, dict[str, Any], str | None, str]] = [
    ("no input", {}, "input", "Field required"),
    ("an empty input", {"input": []}, "input", "input is empty"),
    ("an image", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "kvd serves text models"),
    ("an output for no call", {"input": [{"type": "function_call_output", "call_id": "zz", "output": "x"}]},
     "input[0].call_id", "did not make"),
    ("a call without arguments", {"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     "input[0].arguments", "without arguments"),
    ("arguments that are not JSON", {"input": [call(arguments="{nope")]}, "input[0].arguments", "not JSON"),
    ("a system message after the conversation began",
     {"input": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}, "input[1].role", "before"),
    ("only instructions", {"input": [{"role": "system", "content": "b"}]}, "input", "no user message"),
    # The door replaces the ones kvd issued with their items (test_responses.py); none reaches the conversation.
    ("an unresolved item reference", {"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].id",
     "item_reference"),
    ("an unknown item", {"input": [{"type": "computer_call"}]}, "input[0].type", ""),
    ("background", {"background": True}, "background", "foreground"),
    ("truncation auto", {"truncation": "auto"}, "truncation", "never drops"),
    ("a forced tool without tools", {"tool_choice": "required"}, "tool_choice", "no function tools"),
    ("a forced tool naming none of them", {"tools": [{"type": "function", "name": "f"}],
                                           "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name", "not among"),
    ("a function without a name", {"tools": [{"type": "function"}]}, "tools[0].name", "without a name"),
    ("max_output_tokens of 0", {"max_output_tokens": 0}, "max_output_tokens", ""),
    ("a temperature of 5", {"temperature": 5}, "temperature", ""),
    ("a string for a number", {"max_output_tokens": "5"}, "max_output_tokens", ""),
    ("17 metadata pairs", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16"),
    ("a json_schema without a name", {"text": {"format": {"type": "json_schema", "schema": {}}}},
     "text.format.name", "needs a name"),
    ("a conversation", {"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ("a lone surrogate", {"instructions": "a\ud800"}, "instructions", "surrogate"),
]


@pytest.mark.parametrize("case, fields, param, says", BAD, ids=[b[0] for b in BAD])
def test_what_kvd_refuses_is_a_4xx_naming_the_field(case: str, fields: dict[str, Any], param: str | None,
                                                    says: str) -> None:
    body = {"model": "kvd", "input": "hi", **fields}
    if case == "no input":
        del body["input"]
    with pytest.raises(ApiError) as info:
        conversation(parse(body, CONFIG).input)
    e = info.value
    assert 400 <= e.status < 500 and e.param == param and says in e.message, (e.param, e.message)
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_unknown_fields_and_other_tools_are_accepted() -> None:
    r = req(include=["reasoning.encrypted_content"], reasoning={"effort": "low"}, prompt_cache_key="x",
            tools=[{"type": "web_search"}, {"type": "function", "name": "f", "parameters": {"type": "object"}}])
    assert [t.for_template() for t in r.functions()] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert req(tool_choice="none", tools=[{"type": "function", "name": "f"}]).functions() == []


def test_text_format_is_the_chat_doors_response_format() -> None:
    fmt = req(text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}})
    out = fmt.response_format()
    assert out is not None and out.json_schema is not None
    assert (out.type, out.json_schema.name, out.json_schema.schema_, out.json_schema.strict) == (
        "json_schema", "n", {"type": "object"}, True)
    assert req().response_format() is None


# --- the stream ---


SHAPE = ResponseShape("resp_abc", 1, "builtin:tiny", {"instructions": "x", "store": True}, {"session": "s"})
USAGE = {"prompt_tokens": 10, "completion_tokens": 2, "cached_tokens": 8, "restored_from": "disk"}


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def test_a_text_answer_streams_in_openais_order_with_sequence_numbers() -> None:
    enc = Encoder(SHAPE)
    out = [*enc.encode(AnswerStarted(3)), *enc.encode(AnswerProgress(1, 10)), *enc.encode(AnswerProgress(5, 10)),
           *enc.encode(AnswerDelta(0, "Hel")), *enc.encode(AnswerDelta(1, "lo")),
           *enc.encode(AnswerDone(3, "stop", USAGE, "Hello"))]
    assert kinds(out) == ["response.created", "response.in_progress", "response.in_progress",
                          "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                          "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    final = out[-1]["response"]
    assert final["status"] == "completed" and final["output"] == output_of("resp_abc", "Hello", [])
    assert final["output"][0]["id"] == "msg_abc" and out[3]["item"]["id"] == "msg_abc"
    assert final["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 8}, "output_tokens": 2,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}
    assert final["kvd"]["restored_from"] == "disk" and final["instructions"] == "x"


def test_calls_follow_the_text_and_a_cut_answer_is_incomplete() -> None:
    enc = Encoder(SHAPE)
    calls = (AnswerToolCall(0, "c1", "f", '{"a": 1}'), AnswerToolCall(1, "c2", "g", "{}"))
    out = [*enc.encode(AnswerDelta(0, "Let me look. ")), *[e for c in calls for e in enc.encode(c)],
           *enc.encode(AnswerDone(0, "length", USAGE, "Let me look.", calls))]
    call_events = ["response.output_item.added", "response.function_call_arguments.delta",
                   "response.function_call_arguments.done", "response.output_item.done"]
    assert kinds(out) == ["response.created", "response.in_progress", "response.output_item.added",
                          "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                          "response.content_part.done", "response.output_item.done", *call_events, *call_events,
                          "response.incomplete"]
    final = out[-1]["response"]
    assert out[-1]["type"] == "response.incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in final["output"]] == ["message", "function_call", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Let me look."  # as kept, the calls' text out
    assert [(i["id"], i["call_id"]) for i in final["output"][1:]] == [("fc_abc_0", "c1"), ("fc_abc_1", "c2")]
    added = [e for e in out if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [(0, "message"), (1, "function_call"),
                                                                      (2, "function_call")]


def test_only_calls_make_no_message_and_an_error_is_a_failed_response() -> None:
    enc = Encoder(SHAPE)
    done = enc.encode(AnswerDone(0, "stop", USAGE, "", (AnswerToolCall(0, "c1", "f", "{}"),)))
    assert [i["type"] for i in done[-1]["response"]["output"]] == ["function_call"]
    failed = Encoder(SHAPE).encode(AnswerError("internal", "it broke"))
    assert kinds(failed) == ["response.created", "response.in_progress", "response.failed"]
    assert failed[-1]["response"]["error"] == {"code": "server_error", "message": "it broke"}
    too_long = Encoder(SHAPE).encode(AnswerError("too_large", "past the context"))
    assert too_long[-1]["response"]["error"]["code"] == "context_length_exceeded"


# --- the store ---


def row(rid: str, session: str, answer: int) -> StoredResponse:
    return StoredResponse(rid, session, answer, 0, None, 5.0, {"instructions": "be kind", "metadata": {"k": "v"}})


def test_a_stored_response_shows_its_answer_and_its_input(tmp_path: Path) -> None:
    with Store(tmp_path / "kvd.sqlite") as store:
        sid = store.create_session(title="t")["id"]
        store.append_message(sid, "user", "hello")
        store.append_message(sid, "assistant", "hi there")
        store.update_message(sid, 1, status="complete", finish_reason="stop", usage=USAGE)
        store.append_message(sid, "user", "more")
        store.append_message(sid, "assistant", "", tool_calls=[{"id": "c1", "name": "f", "arguments": "{}"}])
        store.update_message(sid, 3, status="complete", finish_reason="length", usage=USAGE)
        put_response(store, row("resp_1", sid, 1))
        put_response(store, row("resp_2", sid, 3))
        assert get_response(store, "resp_1") == row("resp_1", sid, 1)

        one = stored_object(store, "resp_1", "m")
        assert one is not None and one["status"] == "completed" and one["metadata"] == {"k": "v"}
        assert one["output"] == output_of("resp_1", "hi there", []) and one["usage"]["input_tokens"] == 10
        two = stored_object(store, "resp_2", "m")
        assert two is not None and two["status"] == "incomplete" and two["output"][0]["type"] == "function_call"

        page = input_items(store, "resp_2", order="asc", limit=2, after=None)
        assert page is not None and page["has_more"]
        assert [(i["type"], i.get("role")) for i in page["data"]] == [("message", "user"), ("message", "assistant")]
        rest = input_items(store, "resp_2", order="asc", limit=20, after=page["last_id"])
        assert rest is not None and [i["content"][0]["text"] for i in rest["data"]] == ["more"]
        newest = input_items(store, "resp_2", order="desc", limit=1, after=None)
        assert newest is not None and newest["data"][0]["content"][0]["text"] == "more"

        assert delete_response(store, "resp_1") and not delete_response(store, "resp_1")
        assert stored_object(store, "resp_1", "m") is None and stored_object(store, "resp_2", "m") is not None
        store.truncate_messages(sid, 2)  # the session was cut back before resp_2's answer
        assert stored_object(store, "resp_2", "m") is None
        store.delete_session(sid)
        assert get_response(store, "resp_2") is None  # a session takes its responses with it
