"""session.update, session.delete, per-session params and the session object's cache, on a real daemon."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import client, fed_tokens, greedy_reference, running_daemon

pytestmark = pytest.mark.anyio


async def test_update_title_system_and_params(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            created = (await c.request("session.create", title="before"))["session"]
            sid = created["id"]
            assert created["params"] == {} and created["cache"] == "none"

            reply = await c.request("session.update", session=sid, title="after", system="Be brief.",
                                    params={"temperature": 0.2, "max_tokens": 64})
            assert reply["type"] == "session"
            s = reply["session"]
            assert (s["title"], s["system"]) == ("after", "Be brief.")
            assert s["params"] == {"temperature": 0.2, "max_tokens": 64}

            # A partial params change merges; null clears one key; an absent field is kept.
            s = (await c.request("session.update", session=sid, params={"top_p": 0.5, "max_tokens": None}))["session"]
            assert s["params"] == {"temperature": 0.2, "top_p": 0.5}
            assert (s["title"], s["system"]) == ("after", "Be brief.")
            s = (await c.request("session.update", session=sid, system=None))["session"]
            assert s["system"] is None and s["title"] == "after"

            listed = (await c.request("session.list"))["sessions"]
            assert listed[0]["params"] == {"temperature": 0.2, "top_p": 0.5}
            got = await c.request("session.get", session=sid)
            assert got["session"]["params"] == {"temperature": 0.2, "top_p": 0.5}
            assert got["session"]["updated_at"] == created["updated_at"]  # settings are not use


BAD_UPDATES: list[tuple[dict[str, Any], str, str]] = [
    ({"title": ""}, "bad_request", "'title'"),
    ({"title": "t" * 201}, "bad_request", "'title'"),
    ({"title": 3}, "bad_request", "'title'"),
    ({"system": 3}, "bad_request", "'system'"),
    ({"system": "z" * 32001}, "too_large", "'system'"),
    ({"params": [1]}, "bad_request", "'params'"),
    ({"params": {"seed": 1}}, "bad_request", "unknown param 'seed'"),
    ({"params": {"temperature": 3}}, "bad_request", "'params.temperature' must be in [0, 2]"),
    ({"params": {"top_p": 0}}, "bad_request", "'params.top_p' must be in (0, 1]"),
    ({"params": {"max_tokens": 0}}, "bad_request", "'params.max_tokens' must be 1-4096"),
    ({"params": {"max_tokens": 1.5}}, "bad_request", "'max_tokens' has the wrong type"),
    ({"params": {"max_tokens": True}}, "bad_request", "'max_tokens' has the wrong type"),
]


@pytest.mark.parametrize("fields, code, says", BAD_UPDATES)
async def test_update_refuses_bad_fields_and_changes_nothing(
    tmp_path: Path, fields: dict[str, Any], code: str, says: str
) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            before = (await c.request("session.create", title="kept", system="kept"))["session"]
            reply = await c.request("session.update", session=before["id"], **fields)
            assert (reply["type"], reply["code"]) == ("error", code), reply
            assert says in reply["message"]
            after = (await c.request("session.get", session=before["id"]))["session"]
            assert after == before


async def test_update_and_delete_unknown_session(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            for type_ in ("session.update", "session.delete", "chat.attach"):
                reply = await c.request(type_, session="0123456789abcdef", title="x")
                assert (reply["type"], reply["code"]) == ("error", "unknown_session"), reply


async def test_session_params_are_the_turns_defaults(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            await c.request("session.update", session=sid, params={"max_tokens": 3, "temperature": 0})
            _, done = await c.chat(sid, "Tell me a long story, please.")
            assert done["type"] == "chat.done"
            assert done["usage"]["completion_tokens"] <= 3
            # The request's own value wins over the session's.
            _, done = await c.chat(sid, "More.", max_tokens=8)
            assert done["usage"]["completion_tokens"] == 8 or done["finish_reason"] == "stop"
            # temperature 0 from the session: regenerating gives the same answer every time.
            answers = []
            for _ in range(2):
                await c.send({"id": "again", "type": "chat.regenerate", "session": sid, "max_tokens": 12})
                text = ""
                while (event := await c.recv())["type"] != "chat.done":
                    assert event["type"] in ("chat.start", "chat.delta"), event
                    text += event.get("text", "")
                answers.append(text)
            assert answers[0] == answers[1]


def test_request_then_session_then_config() -> None:
    from daemon.config import Config
    from protocol.shapes import Sampling, merge, resolve

    config = Config(max_tokens=512, temperature=0.7, top_p=1.0, max_tokens_limit=1024)
    session = {"temperature": 0.1, "max_tokens": 2000}  # set before the limit was lowered
    unset = {"max_tokens": None, "temperature": None, "top_p": None}
    limit = config.max_tokens_limit
    assert resolve(unset, {}, config.sampling(), max_tokens_limit=limit) == Sampling.of(512, 0.7, 1.0)
    assert resolve(unset, session, config.sampling(), max_tokens_limit=limit) == Sampling.of(1024, 0.1, 1.0)
    asked = {"max_tokens": 9, "temperature": 0.0, "top_p": 0.5}
    assert resolve(asked, session, config.sampling(), max_tokens_limit=limit) == Sampling.of(9, 0.0, 0.5)
    assert merge(session, {"temperature": None, "top_p": 0.9}) == {"max_tokens": 2000, "top_p": 0.9}


async def test_delete_removes_transcript_and_cache(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            keep = (await c.request("session.create"))["session"]["id"]
            for s in (sid, keep):
                _, done = await c.chat(s, "Hello there.", max_tokens=6, temperature=0)
                assert done["type"] == "chat.done"
            status = await c.request("status")  # through the engine: both turns' caches are kept
            assert {sid, keep} <= set(status["locations"])
            listed = {s["id"]: s for s in (await c.request("session.list"))["sessions"]}
            assert listed[sid]["cache"] == status["locations"][sid]

            assert (await c.request("session.delete", session=sid))["type"] == "ok"
            reply = await c.request("session.get", session=sid)
            assert reply["code"] == "unknown_session"
            status = await c.request("status")  # behind the engine's forget
            assert sid not in status["locations"] and keep in status["locations"]
            assert [s["id"] for s in (await c.request("session.list"))["sessions"]] == [keep]
            assert not list((tmp_path / "cache").glob(f"**/*{sid}*"))


async def test_delete_while_generating_is_busy(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            await c.send({"id": "long", "type": "chat.send", "session": sid, "text": "go on",
                          "max_tokens": 4000, "temperature": 0})
            assert (await c.recv())["type"] == "chat.start"
            await c.send({"id": "del", "type": "session.delete", "session": sid})
            while (event := await c.recv())["id"] != "del":
                assert event["type"] == "chat.delta"
            assert (event["type"], event["code"]) == ("error", "busy")
            # A new system prompt waits for the answer too (the turn runs on the old one's ids);
            # a title or params do not.
            await c.send({"id": "sys", "type": "session.update", "session": sid, "system": "new"})
            while (event := await c.recv())["id"] != "sys":
                assert event["type"] == "chat.delta"
            assert (event["type"], event["code"]) == ("error", "busy")
            await c.send({"id": "title", "type": "session.update", "session": sid, "title": "renamed",
                          "params": {"top_p": 0.9}})
            while (event := await c.recv())["id"] != "title":
                assert event["type"] == "chat.delta"
            assert event["type"] == "session" and event["session"]["title"] == "renamed"
            assert event["session"]["cache"] == "resident"
            await c.send({"id": "stop", "type": "chat.cancel", "session": sid})
            while (event := await c.recv())["type"] != "chat.done":
                pass
            assert (await c.request("session.delete", session=sid))["type"] == "ok"


async def test_new_system_prompt_applies_to_the_next_turn_exactly(tmp_path: Path) -> None:
    """After /system the fed ids no longer prefix the prompt: the next answer is a fresh run's all the same."""
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = (await c.request("session.create", system="You are a pirate."))["session"]["id"]
            _, first = await c.chat(sid, "Where is the treasure?", max_tokens=12, temperature=0)
            assert first["type"] == "chat.done"
            await c.request("session.update", session=sid, system="You are a librarian.")
            _, done = await c.chat(sid, "And the map?", max_tokens=12, temperature=0)
            assert done["type"] == "chat.done", done
            got = await c.request("session.get", session=sid)
    u = done["usage"]
    # The old system prompt's tokens differ from the first on; at most a template prefix is reused.
    assert u["cached_tokens"] < first["usage"]["prompt_tokens"]
    tokens = fed_tokens(tmp_path / "kvd.sqlite", sid)
    prompt = tokens[: u["prompt_tokens"]]

    from mlx_lm.utils import load

    from daemon.prompt import render

    model_dir = tmp_path / "models" / "tiny"
    tokenizer = load(str(model_dir))[1]
    history = [{"role": m["role"], "content": m["content"]} for m in got["messages"][:3]]
    assert prompt == tokenizer.encode(render(tokenizer, history, "You are a librarian."), add_special_tokens=False)
    assert tokens[u["prompt_tokens"]:] == greedy_reference(model_dir, prompt, u["completion_tokens"])


PASTE = "\n".join(f"{i:03d} ERROR disk full on /var/lib/postgres while writing segment {i * 7919 % 1000}"
                  for i in range(60))


async def test_create_with_earlier_turns_reads_none_of_them_again(tmp_path: Path) -> None:
    """/compact's new session used to carry the old turns as text in its system prompt, so nothing of the
    old cache matched and its first answer read the whole paste again. Carried as messages, the new
    session begins as the old one did: its first answer restores them (issue 44, item 11)."""
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            old = (await c.request("session.create", system="Be brief."))["session"]["id"]
            _, first = await c.chat(old, PASTE, max_tokens=4, temperature=0)
            await c.request("status")  # the turn's cache is kept
            said = (await c.request("session.get", session=old))["messages"]
            turns = [{"role": m["role"], "content": m["content"]} for m in said]
            made = (await c.request("session.create", title="Carried", system="Be brief.", messages=turns))
            assert made["type"] == "session", made
            new = made["session"]
            assert (new["message_count"], new["title"], new["system"]) == (2, "Carried", "Be brief.")
            got = await c.request("session.get", session=new["id"])
            assert [(m["role"], m["content"], m["status"]) for m in got["messages"]] == [
                ("user", PASTE, "complete"), ("assistant", turns[1]["content"], "complete")]
            assert all(m["usage"] is None for m in got["messages"])  # stored, never answered
            _, done = await c.chat(new["id"], "Which disk?", max_tokens=2, temperature=0)
    usage = done["usage"]
    read = first["usage"]["prompt_tokens"]  # the system prompt and the paste, as the old session read them
    assert read > 600, first
    assert usage["restored_from"] == "shared" and usage["shared_tokens"] >= read, usage
    assert usage["prefill_tokens"] < 40, usage  # the old answer's end and the new question, not the paste


BAD_CARRIED: list[tuple[Any, str, str]] = [
    ("hello", "bad_request", "'messages' must be an array"),
    (["hello"], "bad_request", "'messages[0]' must be an object with exactly 'role' and 'content'"),
    ([{"role": "user", "content": "a", "name": "x"}, {"role": "assistant", "content": "b"}], "bad_request",
     "'messages[0]' must be an object with exactly 'role' and 'content'"),
    ([{"role": "assistant", "content": "a"}], "bad_request", "'messages[0].role' must be 'user'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "bad_request",
     "'messages[1].role' must be 'assistant'"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "bad_request",
     "'messages[1].role' must be 'assistant'"),
    ([{"role": "user", "content": " "}, {"role": "assistant", "content": "b"}], "bad_request",
     "'messages[0].content' must be a non-empty string"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}], "bad_request",
     "'messages[1].content' must be a non-empty string"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "z" * 32001}], "too_large",
     "'messages[1].content' is longer than 32000 characters"),
    ([{"role": "user", "content": "a"}], "bad_request", "'messages' ends with a user message without its answer"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 1001, "too_large",
     "'messages' holds 2002 messages; a session starts with at most 2000 (carry the most recent turns)"),
]


@pytest.mark.parametrize("messages, code, says", BAD_CARRIED)
async def test_create_refuses_bad_earlier_turns_and_stores_nothing(
    tmp_path: Path, messages: Any, code: str, says: str
) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            reply = await c.request("session.create", title="never", messages=messages)
            assert (reply["type"], reply["code"]) == ("error", code), reply
            assert says in reply["message"], reply
            assert (await c.request("session.list"))["sessions"] == []
            assert (await c.request("ping"))["type"] == "pong"  # still serving
