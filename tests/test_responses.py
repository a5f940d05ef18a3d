"""The Responses door through the official `openai` client, against a real daemon (builtin:tiny, and a model
that calls tools): answers and streams, stored responses continued, branched and deleted, `store: false`
placed like any stateless client, tool round trips, JSON output, and refusals that store nothing."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest

from conftest import RunningDaemon, running_daemon
from toolmodel import WEATHER_TOOL, write_tool_model

pytestmark = pytest.mark.anyio

MODEL = "builtin:tiny"
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}
# The Responses shape: name and parameters at the top.
TOOL: dict[str, Any] = {"type": "function", **cast(dict[str, Any], WEATHER_TOOL["function"])}
LONG = " ".join(f"Rule {i}: answer in plain words and keep every promise made earlier." for i in range(60))


@asynccontextmanager
async def api(tmp_path: Path, **overrides: Any) -> AsyncIterator[tuple[openai.AsyncOpenAI, RunningDaemon]]:
    async with running_daemon(tmp_path, **overrides) as d:
        client = openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token, max_retries=0)
        try:
            yield client, d
        finally:
            await client.close()


def stored(d: RunningDaemon) -> tuple[int, int, int]:
    """(sessions, messages, responses) in the daemon's database, read beside it."""
    db = sqlite3.connect(f"file:{d.config.db_path}?mode=ro", uri=True)
    try:
        sessions, messages, responses = (db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                                         for t in ("sessions", "messages", "responses"))
        return sessions, messages, responses
    finally:
        db.close()


def session_of(response: Any) -> str:
    return str(response.model_extra["kvd"]["session"])


async def test_create_then_continue_then_stream_then_get(tmp_path: Path) -> None:
    async with api(tmp_path) as (client, d):
        first = await client.responses.create(input="Tell me about rivers.", instructions=LONG, **GREEDY)
        assert first.id.startswith("resp_") and first.status in ("completed", "incomplete")
        assert first.output_text and first.usage is not None and first.instructions == LONG
        second = await client.responses.create(input="And lakes?", previous_response_id=first.id,
                                               instructions=LONG, **GREEDY)
        assert session_of(second) == session_of(first)  # the latest response: its session goes on
        assert second.usage is not None and first.usage is not None
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # its cache, kept

        seen: list[Any] = []
        async with client.responses.stream(input="And seas?", previous_response_id=second.id, instructions=LONG,
                                           **GREEDY) as stream:
            async for event in stream:
                seen.append(event)
        kinds = [e.type for e in seen]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              kinds[-1]] and kinds[-1] in ("response.completed", "response.incomplete")
        assert [e.sequence_number for e in seen] == list(range(len(seen)))
        text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        final = seen[-1].response
        assert final.output_text == text and session_of(final) == session_of(first)

        again = await client.responses.retrieve(final.id)
        assert again.output_text == text and again.status == final.status and again.usage == final.usage
        items = await client.responses.input_items.list(final.id, order="asc")
        assert [(i.type, getattr(i, "role", None)) for i in items.data] == [
            ("message", "user"), ("message", "assistant")] * 2 + [("message", "user")]
        assert items.data[-1].model_dump()["content"][0]["text"] == "And seas?"


async def test_an_item_reference_to_an_item_kvd_stored_continues_with_its_cache(tmp_path: Path) -> None:
    """The AI SDK's default OpenAI provider (store: true) sends earlier answers back as item_references to the
    ids kvd issued (it was a 400): each resolves to the stored item, and the conversation is placed on the
    session that holds it, read from its cache. An id kvd did not store here is a 400 naming it."""
    async with api(tmp_path) as (client, d):
        first = await client.responses.create(input="Tell me about rivers.", instructions=LONG, **GREEDY)
        (answer,) = first.output
        asked: Any = [{"role": "user", "content": "Tell me about rivers."}, {"type": "item_reference", "id": answer.id},
                      {"role": "user", "content": "And lakes?"}]
        second = await client.responses.create(input=asked, instructions=LONG, **GREEDY)
        assert session_of(second) == session_of(first)  # the referenced answer is the stored one, word for word
        assert second.usage is not None and first.usage is not None
        assert second.usage.input_tokens_details.cached_tokens >= 0.9 * first.usage.input_tokens, second.usage
        # input_items' ids name the stored messages too (user and assistant alike).
        items = (await client.responses.input_items.list(second.id, order="asc")).data
        (latest,) = second.output
        referenced: Any = [*({"type": "item_reference", "id": i.id} for i in items),
                           {"type": "item_reference", "id": latest.id}, {"role": "user", "content": "And seas?"}]
        third = await client.responses.create(input=referenced, instructions=LONG, **GREEDY)
        assert session_of(third) == session_of(first)

        unstored = await client.responses.create(input="Not kept.", store=False, **GREEDY)
        for unknown in (unstored.output[0].id, "msg_nope", f"msg_{'0' * 24}", "rs_abc"):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(input=[{"type": "item_reference", "id": unknown}], **GREEDY)
            error: Any = refused.value.body
            assert error["param"] == "input[0].id" and repr(unknown) in error["message"], error


async def test_continuing_an_older_response_branches_and_leaves_the_newer_one(tmp_path: Path) -> None:
    async with api(tmp_path) as (client, d):
        one = await client.responses.create(input="Let us talk about trees.", instructions=LONG, **GREEDY)
        two = await client.responses.create(input="Which birds live there?", previous_response_id=one.id,
                                            instructions=LONG, **GREEDY)
        before = [i.model_dump() for i in (await client.responses.input_items.list(two.id)).data]
        held = await d.daemon.turns.transcripts.read(lambda s: s.messages(session_of(two)))

        branch = await client.responses.create(input="Which trees grow fastest?", previous_response_id=one.id,
                                               instructions=LONG, **GREEDY)
        assert session_of(branch) != session_of(one)  # a new session: nothing that followed `one` is erased
        assert branch.usage is not None and one.usage is not None
        assert branch.usage.input_tokens_details.cached_tokens > 0  # the prefix they share, from its blocks
        items = [i.model_dump() for i in (await client.responses.input_items.list(branch.id, order="asc")).data]
        assert len(items) == 3 and items[-1]["content"][0]["text"] == "Which trees grow fastest?"

        # The newer response's conversation is as it was, and it goes on from its own cache.
        assert [i.model_dump() for i in (await client.responses.input_items.list(two.id)).data] == before
        assert await d.daemon.turns.transcripts.read(lambda s: s.messages(session_of(two))) == held
        three = await client.responses.create(input="Name one more.", previous_response_id=two.id,
                                              instructions=LONG, **GREEDY)
        assert session_of(three) == session_of(two)
        assert three.usage is not None and two.usage is not None
        assert three.usage.input_tokens_details.cached_tokens >= two.usage.input_tokens
        # And the branch goes on from its own.
        four = await client.responses.create(input="Why?", previous_response_id=branch.id, instructions=LONG,
                                             **GREEDY)
        assert session_of(four) == session_of(branch)
        assert four.usage is not None and four.usage.input_tokens_details.cached_tokens >= branch.usage.input_tokens


async def test_store_false_keeps_no_response_and_a_resent_input_is_placed_like_chat(tmp_path: Path) -> None:
    async with api(tmp_path) as (client, d):
        before = stored(d)
        convo: list[Any] = [{"role": "developer", "content": LONG}, {"role": "user", "content": "hello"}]
        first = await client.responses.create(input=convo, store=False, **GREEDY)
        assert stored(d)[2] == before[2]  # no response row
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as info:
            await client.responses.create(input="more", previous_response_id=first.id, **GREEDY)
        assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
        # The client sends its whole input again, with the answer's items as it got them (Codex does).
        convo += [item.model_dump(exclude_none=True) for item in first.output]
        convo.append({"role": "user", "content": "more"})
        second = await client.responses.create(input=convo, store=False, **GREEDY)
        assert session_of(second) == session_of(first)  # continued, as the chat door places it
        assert second.usage is not None and first.usage is not None
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


async def test_delete_forgets_the_response_not_the_conversation(tmp_path: Path) -> None:
    async with api(tmp_path) as (client, d):
        one = await client.responses.create(input="first", **GREEDY)
        two = await client.responses.create(input="second", previous_response_id=one.id, **GREEDY)
        await client.responses.delete(one.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(one.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(one.id)
        three = await client.responses.create(input="third", previous_response_id=two.id, **GREEDY)
        assert session_of(three) == session_of(one)  # the conversation is all there


async def test_input_tokens_counts_what_the_turn_reads_and_stores_nothing(tmp_path: Path) -> None:
    async with api(tmp_path) as (client, d):
        one = await client.responses.create(input="count me", instructions="Be brief.", **GREEDY)
        before = stored(d)
        counted = await client.responses.input_tokens.count(model=MODEL, input="and me", instructions="Be brief.",
                                                            previous_response_id=one.id)
        assert stored(d) == before
        two = await client.responses.create(input="and me", instructions="Be brief.", previous_response_id=one.id,
                                            **GREEDY)
        assert two.usage is not None and counted.input_tokens == two.usage.input_tokens


async def test_text_format_json_schema_is_followed(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    async with api(tmp_path) as (client, d):
        r = await client.responses.create(input="a number", text={"format": {
            "type": "json_schema", "name": "number", "schema": schema, "strict": True}},
            **{**GREEDY, "max_output_tokens": 40})
        if r.status == "completed":
            assert set(json.loads(r.output_text)) == {"n"}
        else:  # cut by max_output_tokens: a prefix of the schema's JSON
            assert "".join(r.output_text.split()).startswith('{"n":'), r.output_text


REFUSED: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("an unknown previous response", {"input": "x", "previous_response_id": "resp_nope"}, 404,
     "previous_response_not_found"),
    ("a schema that cannot end", {"input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                                                    "schema": {"$ref": "#"}}}}, 400, None),
    ("past the context", {"input": "x " * 15_500, "previous_response_id": "KEPT"}, 400, "context_length_exceeded"),
    ("an image", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, 400, None),
    ("not JSON", {}, 400, None),
    ("a model kvd cannot serve", {"input": "x", "model": "gpt-5"}, 404, "model_not_found"),
]


@pytest.mark.parametrize("case, body, status, code", REFUSED, ids=[r[0] for r in REFUSED])
async def test_a_refusal_is_openais_error_shape_and_stores_nothing(tmp_path: Path, case: str, body: dict[str, Any],
                                                                    status: int, code: str | None) -> None:
    async with api(tmp_path) as (client, d):
        kept = await client.responses.create(input="kept", **GREEDY)
        if body.get("previous_response_id") == "KEPT":
            body = {**body, "previous_response_id": kept.id}
        before = stored(d)
        async with httpx.AsyncClient(base_url=d.url.replace("ws://", "http://"),
                                     headers={"Authorization": f"Bearer {d.token}"}) as http:
            r = await http.post("responses", content=b"{nope" if case == "not JSON" else
                                json.dumps({"model": MODEL, **body}).encode(), timeout=60)
            stream = await http.post("responses", json={"model": MODEL, "stream": True, **body}, timeout=60) \
                if case != "not JSON" else r
        for reply in (r, stream):
            assert reply.status_code == status, (case, reply.text[:300])
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and (code is None or error["code"] == code), error
        if case == "past the context":
            assert "context of" in r.text and "builtin:gemma3" in r.text, r.text
        assert stored(d) == before, case
        again = await client.responses.create(input="still here", previous_response_id=kept.id, **GREEDY)
        assert session_of(again) == session_of(kept)  # the conversation was not touched


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tool_model(tmp_path_factory.mktemp("tool-model"))


async def test_a_tool_round_trip_call_output_answer(tool_model: Path, tmp_path: Path) -> None:
    async with api(tmp_path, model=str(tool_model)) as (client, d):
        ask: dict[str, Any] = {"model": tool_model.name, "tools": [TOOL], "max_output_tokens": 20, "temperature": 0,
               "instructions": "Use the tools."}
        first = await client.responses.create(input="What is the weather in Paris?", **ask)
        (call,) = [item for item in first.output if item.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")

        # The client runs the tool and sends its output, continuing the response that called it.
        output: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}
        seen: list[Any] = []
        async with client.responses.stream(input=[output], previous_response_id=first.id, **ask) as stream:
            async for event in stream:
                seen.append(event)
        second = seen[-1].response
        assert session_of(second) == session_of(first)
        assert second.usage.input_tokens_details.cached_tokens > 0  # the session's cache
        # The script calls again (a model would answer): streamed as a call item, with its arguments.
        kinds = [e.type for e in seen]
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
        assert [i.type for i in second.output] == ["function_call"]
        items = (await client.responses.input_items.list(second.id, order="asc")).data
        assert [i.type for i in items] == ["message", "function_call", "function_call_output"]

        # The same round trip, stateless: the whole input sent again, as Codex does.
        convo: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"},
                            *[i.model_dump(exclude_none=True) for i in first.output], output]
        third = await client.responses.create(input=convo, store=False, **ask)
        assert third.usage is not None and third.usage.input_tokens_details.cached_tokens > 0
        # And with the call as an item_reference to the id kvd issued (the AI SDK's store: true).
        referenced: list[Any] = [convo[0], {"type": "item_reference", "id": call.id}, output]
        fourth = await client.responses.create(input=referenced, **ask)
        assert fourth.usage is not None and fourth.usage.input_tokens == third.usage.input_tokens
        assert fourth.usage.input_tokens_details.cached_tokens > 0


async def test_no_max_output_tokens_is_as_much_as_the_context_leaves(tool_model: Path, tmp_path: Path) -> None:
    """Codex names no max_output_tokens. As OpenAI's, that is up to what the model may write
    (limits.max_tokens_limit, 4096) within the context, not the chat default (512, which Codex reported as
    an incomplete response): beside a 4.4k-token input the 4096 no longer fit the 8k context, and the answer
    gets the room it leaves instead of a refusal. (The tool model ends every answer after its call.)"""
    async with api(tmp_path, model=str(tool_model)) as (client, d):
        long = await client.responses.create(model=tool_model.name, input="x " * 2_200, temperature=0)
        short = await client.responses.create(model=tool_model.name, input="hi", temperature=0)
    assert long.usage is not None and long.usage.input_tokens + 4_096 > 8_192, long.usage
    assert long.status == short.status == "completed", (long.status, short.status)
    assert long.max_output_tokens is None  # what was asked is shown as asked


async def test_top_logprobs_are_the_output_texts(tmp_path: Path) -> None:
    """top_logprobs: each output token's log-probability and its alternatives, in the output_text, streamed or
    not, the same as the chat door gives for the same answer."""
    import openai

    async with running_daemon(tmp_path) as d:
        api = openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token, max_retries=0)
        made = await api.responses.create(model="builtin:tiny", input="Count.", max_output_tokens=6, temperature=0,
                                          top_logprobs=2)
        chat = await api.chat.completions.create(model="builtin:tiny", messages=[{"role": "user", "content": "Count."}],
                                                 max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
        await api.close()
    (item,) = [o for o in made.output if o.type == "message"]
    part = item.content[0]
    assert part.type == "output_text" and part.logprobs
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    assert [(t.token, len(t.top_logprobs)) for t in part.logprobs] == [
        (t.token, 2) for t in chat.choices[0].logprobs.content]
