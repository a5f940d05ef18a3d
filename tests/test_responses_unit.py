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
from sessions.responses import (
    Points,
    StoredResponse,
    answered_at,
    branch_away,
    delete_response,
    get_response,
    put_response,
)

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


def test_a_reasoning_item_is_the_reasoning_of_the_answer_it_comes_with() -> None:
    def reasoning(text: str, *, summary: bool = False) -> dict[str, Any]:
        part = {"type": "summary_text" if summary else "reasoning_text", "text": text}
        return {"type": "reasoning", "id": "rs_1", **({"summary": [part]} if summary else {"summary": [],
                                                                                            "content": [part]})}

    items = [{"role": "user", "content": "a"}, reasoning("first"),  # before the answer's text
             {"role": "assistant", "content": "b"}, reasoning("then", summary=True), call("c1"),  # between its calls
             {"type": "function_call_output", "call_id": "c1", "output": "x"},
             reasoning("alone"), call("c2"),  # before a call with no text
             {"type": "function_call_output", "call_id": "c2", "output": "y"},
             reasoning("answered by nothing"), {"role": "user", "content": "and?"}]
    new = conversation(req(input=items).input)
    c1, c2 = ({"id": c, "name": "f", "arguments": "{}"} for c in ("c1", "c2"))
    assert new.messages == (Said("user", "a"), Said("assistant", "b", (c1,), reasoning="first\nthen"),
                            Said("tool", "x", (), "c1"), Said("assistant", "", (c2,), reasoning="alone"),
                            Said("tool", "y", (), "c2"), Said("user", "and?"))
    assert new.messages[1].for_template()["reasoning"] == "first\nthen"


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

        assert delete_response(store, "resp_1") == (sid, 1) and delete_response(store, "resp_1") is None
        assert stored_object(store, "resp_1", "m") is None and stored_object(store, "resp_2", "m") is not None
        store.truncate_messages(sid, 2)  # the session was cut back before resp_2's answer
        assert stored_object(store, "resp_2", "m") is None
        store.delete_session(sid)
        assert get_response(store, "resp_2") is None  # a session takes its responses with it


def test_a_rewrite_branches_the_responses_it_would_touch_away_and_they_show_what_they_did(tmp_path: Path) -> None:
    with Store(tmp_path / "kvd.sqlite") as store:
        sid = store.create_session(title="t", system="be brief", origin="api (x)")["id"]
        for i, (role, text) in enumerate([("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"),
                                          ("user", "e"), ("assistant", "f")]):
            store.append_message(sid, role, text)
            if role == "assistant":
                store.update_message(sid, i, status="complete", finish_reason="stop", usage=USAGE, fed_end=10 * i)
        store.set_tokens(sid, list(range(50)), covers=6, model="m")
        for rid, answer in (("resp_1", 1), ("resp_3", 3), ("resp_5", 5)):
            put_response(store, row(rid, sid, answer))
        assert answered_at(store, sid) == [1, 3, 5]
        shown = {rid: (stored_object(store, rid, "m"), input_items(store, rid, order="asc", limit=20, after=None))
                 for rid in ("resp_1", "resp_3", "resp_5")}

        # An edit of message 2 touches resp_3 and resp_5 (their input or answer): they go, with messages 0-5.
        assert branch_away(store, session_id=sid, new_id="b" * 16, end=6, moving_from=2, tokens=list(range(30)),
                           covers=4, model="m") == 2
        store.truncate_messages(sid, 2)
        assert answered_at(store, sid) == [1] and answered_at(store, "b" * 16) == [3, 5]
        for rid, (got, items) in shown.items():
            assert input_items(store, rid, order="asc", limit=20, after=None) == items  # the ids they had
            moved = stored_object(store, rid, "m")
            assert moved is not None and got is not None
            assert {**moved, "kvd": None} == {**got, "kvd": None}
            assert moved["kvd"]["session"] == (sid if rid == "resp_1" else "b" * 16)
        branch = store.get_session("b" * 16)
        assert branch is not None and (branch["title"], branch["system"], branch["origin"]) == ("t", "be brief",
                                                                                             "api (x)")
        assert [m["content"] for m in store.messages("b" * 16)] == list("abcdef")
        assert store.fed("b" * 16) == (list(range(30)), 4)  # its own checksum: verified as it is read
        # A second rewrite of the branch keeps the ids its responses' items were first listed under.
        assert branch_away(store, session_id="b" * 16, new_id="c" * 16, end=6, moving_from=4, tokens=[],
                           covers=0, model=None) == 1
        assert input_items(store, "resp_5", order="asc", limit=20, after=None) == shown["resp_5"][1]


def test_points_forget_what_a_rewrite_moved() -> None:
    points = Points(size=2)
    points.remember("r1", "s", 1)
    points.remember("r3", "s", 3)
    points.moved("s", 2)
    assert points.get("r1") == ("s", 1) and points.get("r3") is None
    points.remember("r5", "t", 5)
    points.remember("r7", "t", 7)
    assert points.get("r1") is None  # the least recently used went


def test_an_item_id_names_the_item_it_was_issued_for_after_its_session_is_rewritten(tmp_path: Path) -> None:
    from daemon.doors.responses_stored import referenced

    with Store(tmp_path / "kvd.sqlite") as store:
        sid = store.create_session(title="t")["id"]
        for role, text in [("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")]:
            store.append_message(sid, role, text)
        put_response(store, row("resp_3", sid, 3))
        old = input_items(store, "resp_3", order="asc", limit=20, after=None)
        assert old is not None
        old_ids = [i["id"] for i in old["data"]]
        # An edit of message 2: resp_3 goes with its conversation, the session is cut and goes on.
        branch_away(store, session_id=sid, new_id="b" * 16, end=4, moving_from=2, tokens=[], covers=0, model=None)
        store.truncate_messages(sid, 2)
        for role, text in [("user", "C"), ("assistant", "D"), ("user", "E")]:
            store.append_message(sid, role, text)
        put_response(store, row("resp_new", sid, 3))
        new = input_items(store, "resp_new", order="asc", limit=20, after=None)
        assert new is not None and input_items(store, "resp_3", order="asc", limit=20, after=None) == old
        new_ids = [i["id"] for i in new["data"]]
        assert new_ids[:2] == old_ids[:2] and not set(new_ids[2:]) & set(old_ids)  # rewritten: other names
        found = referenced(store, [*old_ids, *new_ids])
        assert [found[i]["content"] for i in old_ids] == ["a", "b", "c"]  # still what they were issued for
        assert [found[i]["content"] for i in new_ids] == ["a", "b", "C"]


def test_an_item_id_is_not_taken_by_a_branch_that_went_on_and_was_cut_itself(tmp_path: Path) -> None:
    from daemon.doors.responses_stored import referenced

    def say(store: Store, session: str, *texts: str) -> None:  # a user's turn at each even index
        for text in texts:
            store.append_message(session, "assistant" if len(store.messages(session)) % 2 else "user", text)

    def ids(rid: str) -> list[str]:
        items = input_items(store, rid, order="asc", limit=50, after=None)
        assert items is not None
        return [i["id"] for i in items["data"]]

    b1, s2 = "b" * 16, "c" * 16
    with Store(tmp_path / "kvd.sqlite") as store:
        sid = store.create_session(title="t")["id"]
        say(store, sid, "a", "b", "c", "d")
        put_response(store, row("resp_3", sid, 3))
        # An edit of message 2: resp_3 keeps its conversation in b1, and the session goes on (its first cut).
        branch_away(store, session_id=sid, new_id=b1, end=4, moving_from=2, tokens=[], covers=0, model=None)
        store.truncate_messages(sid, 2)
        say(store, sid, "C", "D", "E", "F")
        put_response(store, row("resp_s5", sid, 5))
        named = ids("resp_s5")  # message 4 of the session, written after its first cut
        # resp_3 is continued in b1, which is then cut itself (its own first cut) and goes on.
        say(store, b1, "e", "f")
        put_response(store, row("resp_b5", b1, 5))
        branch_away(store, session_id=b1, new_id="d" * 16, end=6, moving_from=4, tokens=[], covers=0, model=None)
        store.truncate_messages(b1, 4)
        say(store, b1, "not the session's E", "nor its F")
        # The session is cut again before message 4: resp_s5 keeps it in s2.
        branch_away(store, session_id=sid, new_id=s2, end=6, moving_from=2, tokens=[], covers=0, model=None)
        store.truncate_messages(sid, 2)
        say(store, sid, "x", "y", "z")
        assert ids("resp_s5") == named
        found = referenced(store, named)
        assert [found[i]["content"] for i in named] == ["a", "b", "C", "D", "E"]
