"""A stored response names one answer forever: rewriting its session in place (kvchat's regenerate and
edit, a pinned request's rewind at each HTTP door) branches the old conversation away, so the old id
returns exactly what it returned and continues exactly what it answered. A real daemon (builtin:tiny),
the official `openai` and `anthropic` clients, kvd's own websocket."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from conftest import RunningDaemon, client, running_daemon

pytestmark = pytest.mark.anyio

MODEL = "builtin:tiny"
# Instructions long enough to fill cache blocks: what a branch shares with its rewritten session is restored.
LONG = " ".join(f"Rule {i}: answer in plain words and keep every promise made earlier." for i in range(30))
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_output_tokens": 8, "instructions": LONG}


def session_of(response: Any) -> str:
    return str(response.model_extra["kvd"]["session"])


def shown(response: Any) -> dict[str, Any]:
    """What GET returns, less kvd's own field naming the session that holds the conversation now."""
    out: dict[str, Any] = response.model_dump()
    out.pop("kvd", None)
    return out


async def looks(c: openai.AsyncOpenAI, rid: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The response as GET returns it, and its input items (oldest first)."""
    got = await c.responses.retrieve(rid)
    items = await c.responses.input_items.list(rid, order="asc", limit=100)
    return shown(got), [i.model_dump() for i in items.data]


def texts(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(i["role"], i["content"][0]["text"]) for i in items if i["type"] == "message"]


async def regenerate(d: RunningDaemon, sid: str, *_: Any) -> None:
    async with client(d) as c:
        await c.send({"id": "again", "type": "chat.regenerate", "session": sid, "max_tokens": 6, "temperature": 1})
        while (e := await c.recv())["type"] not in ("chat.done", "error"):
            pass
        assert e["type"] == "chat.done", e


async def edit(d: RunningDaemon, sid: str, *_: Any) -> None:
    async with client(d) as c:
        await c.send({"id": "edit", "type": "chat.edit", "session": sid, "message_index": 0,
                      "text": "Something else entirely.", "max_tokens": 6})
        while (e := await c.recv())["type"] not in ("chat.done", "error"):
            pass
        assert e["type"] == "chat.done", e


async def rewind_chat(d: RunningDaemon, sid: str, oc: openai.AsyncOpenAI, ac: anthropic.AsyncAnthropic) -> None:
    await oc.chat.completions.create(model=MODEL, max_tokens=6, messages=[{"role": "system", "content": LONG},
                                                                          {"role": "user", "content": "Rewound."}],
                                     extra_headers={"X-Kvd-Session": sid, "X-Kvd-Rewind": "true"})


async def rewind_messages(d: RunningDaemon, sid: str, oc: openai.AsyncOpenAI, ac: anthropic.AsyncAnthropic) -> None:
    await ac.messages.create(model=MODEL, max_tokens=6,  # another system prompt (none) too
                             messages=[{"role": "user", "content": "Rewound here."}],
                             extra_headers={"X-Kvd-Session": sid, "X-Kvd-Rewind": "true"})


async def rewind_responses(d: RunningDaemon, sid: str, oc: openai.AsyncOpenAI, ac: anthropic.AsyncAnthropic) -> None:
    await oc.responses.create(input="Rewound by the Responses door.", store=False, **GREEDY,
                              extra_headers={"X-Kvd-Session": sid, "X-Kvd-Rewind": "true"})


REWRITES: dict[str, Callable[..., Awaitable[None]]] = {
    "chat.regenerate": regenerate, "chat.edit": edit, "chat completions rewind": rewind_chat,
    "messages rewind": rewind_messages, "responses rewind": rewind_responses}
NEW_SYSTEM = {"messages rewind"}  # the rewritten session's memory no longer holds the branch's prefix


@pytest.mark.parametrize("how", REWRITES)
async def test_rewriting_a_session_never_changes_what_a_response_id_names(tmp_path: Path, how: str) -> None:
    async with running_daemon(tmp_path, model=MODEL) as d:
        base = d.url.replace("ws://", "http://").removesuffix("/v1")
        async with (openai.AsyncOpenAI(base_url=base + "/v1", api_key=d.token, max_retries=0) as oc,
                    anthropic.AsyncAnthropic(base_url=base, api_key=d.token, max_retries=0) as ac):
            one = await oc.responses.create(input=f"Tell me about {how}.", **GREEDY)
            two = await oc.responses.create(input="And more?", previous_response_id=one.id, **GREEDY)
            sid = session_of(two)
            assert session_of(one) == sid
            before = {r.id: await looks(oc, r.id) for r in (one, two)}
            transcript = d.store.messages(sid)
            await REWRITES[how](d, sid, oc, ac)
            assert d.store.messages(sid) != transcript  # rewritten in place
            for rid, was in before.items():
                assert await looks(oc, rid) == was, rid
            # The items' ids name what they were issued for, not what the rewrite put at their place.
            refs: list[Any] = [{"type": "item_reference", "id": i["id"]} for i in before[two.id][1]]
            again = await oc.responses.create(input=[*refs, {"role": "user", "content": "Once more."}], **GREEDY)
            assert texts((await looks(oc, again.id))[1]) == [*texts(before[two.id][1]), ("user", "Once more.")]
            # Continuing the old ids continues their own conversation, not the rewritten one.
            go_on = await oc.responses.create(input="Go on.", previous_response_id=two.id, **GREEDY)
            _, items = await looks(oc, go_on.id)
            assert texts(items) == [*texts(before[two.id][1]), ("assistant", two.output_text), ("user", "Go on.")]
            branch = session_of(await oc.responses.retrieve(two.id))  # the old conversation, beside the rewritten one
            assert branch != sid and session_of(go_on) == branch  # continuing its latest response extends it
            assert d.store.get_session(branch)["system"] == LONG  # type: ignore[index]
            assert go_on.usage is not None
            if how not in NEW_SYSTEM:  # the prefix the two share, from the rewritten session's memory
                assert go_on.usage.input_tokens_details.cached_tokens > 0
            older = await oc.responses.create(input="Back to the start.", previous_response_id=one.id, **GREEDY)
            _, items = await looks(oc, older.id)
            assert texts(items) == [*texts(before[one.id][1]), ("assistant", one.output_text),
                                    ("user", "Back to the start.")]
    async with running_daemon(tmp_path, model=MODEL) as d:  # and after a restart
        base = d.url.replace("ws://", "http://").removesuffix("/v1")
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=d.token, max_retries=0) as oc:
            for rid, was in before.items():
                assert await looks(oc, rid) == was, rid


async def extend(oc: openai.AsyncOpenAI, d: RunningDaemon, sid: str, text: str) -> Any:
    """A stored response that goes on with the session as it is now (the whole conversation, pinned to it)."""
    said: list[Any] = [{"role": m["role"], "content": m["content"]} for m in d.store.messages(sid)]
    r = await oc.responses.create(input=[*said, {"role": "user", "content": text}], **GREEDY,
                                  extra_headers={"X-Kvd-Session": sid})
    assert session_of(r) == sid
    return r


async def test_a_regenerate_an_edit_and_rewinds_in_turn_leave_every_id_as_it_was(tmp_path: Path) -> None:
    """One session rewritten again and again (each rewrite after a new stored response on it): every id
    issued before any of them returns, lists and names what it did, through branches of branches."""
    async with running_daemon(tmp_path, model=MODEL) as d:
        base = d.url.replace("ws://", "http://").removesuffix("/v1")
        async with (openai.AsyncOpenAI(base_url=base + "/v1", api_key=d.token, max_retries=0) as oc,
                    anthropic.AsyncAnthropic(base_url=base, api_key=d.token, max_retries=0) as ac):
            first = await oc.responses.create(input="Tell me a story.", **GREEDY)
            sid = session_of(first)
            seen = {first.id: await looks(oc, first.id)}
            # The Messages door's rewind drops the system prompt, which a pinned request must then match: last.
            for how in ("chat.regenerate", "chat.edit", "chat completions rewind", "responses rewind",
                        "messages rewind"):
                made = await extend(oc, d, sid, f"Before the {how}.")
                seen[made.id] = await looks(oc, made.id)
                await REWRITES[how](d, sid, oc, ac)
                assert session_of(await oc.responses.retrieve(made.id)) != sid, how  # branched away
                for rid, was in seen.items():
                    assert await looks(oc, rid) == was, (how, rid)
            for rid, (_, items) in seen.items():  # every item id still names what it was issued for
                refs: list[Any] = [{"type": "item_reference", "id": i["id"]} for i in items]
                again = await oc.responses.create(input=[*refs, {"role": "user", "content": "Once more."}], **GREEDY)
                assert texts((await looks(oc, again.id))[1]) == [*texts(items), ("user", "Once more.")], rid
