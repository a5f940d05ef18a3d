"""`n` > 1 through the official `openai` client against a real daemon: the choices decode as one batch over one
prefill (docs/openai.md, "Several choices").

Choice i draws with seed + i, so it is the answer the same request gets alone with n = 1 and that seed; the
prompt is read once (the usage counts it once, and /metrics' prefilled tokens move by it once); each choice is
kept in a session of its own, where a client that goes on from it is placed. Every answer is on builtin:tiny
(pinned: the default model may change).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import RunningDaemon, client, running_daemon

pytestmark = pytest.mark.anyio

MODEL = "builtin:tiny"
ASK: Any = [{"role": "user", "content": "Tell me about the sea, the sky and the hills."}]


def api(d: RunningDaemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token, max_retries=0)


def base(d: RunningDaemon) -> str:
    return d.url.replace("ws://", "http://").removesuffix("/v1")


async def counter(d: RunningDaemon, name: str) -> float:
    """A counter of /metrics, summed over its labels (prometheus_client's own parser reads it)."""
    async with httpx.AsyncClient(base_url=base(d)) as http:
        text = (await http.get("/metrics", headers={"Authorization": f"Bearer {d.token}"})).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def kvd(obj: Any) -> dict[str, Any]:
    found: dict[str, Any] = (obj.model_extra or {})["kvd"]
    return found


async def test_four_choices_from_one_prefill_each_the_answer_its_seed_gives_alone(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model=MODEL) as d:
        async with client(d):
            pass  # ready
        chat = api(d)
        prefilled = await counter(d, "kvd_prefilled_tokens_total")
        decoded = await counter(d, "kvd_decoded_tokens_total")
        four = await chat.chat.completions.create(model=MODEL, messages=ASK, n=4, temperature=0.8, seed=7,
                                                  max_tokens=24)
        moved = (await counter(d, "kvd_prefilled_tokens_total") - prefilled,
                 await counter(d, "kvd_decoded_tokens_total") - decoded)
        alone = [await chat.chat.completions.create(model=MODEL, messages=ASK, temperature=0.8, seed=7 + i,
                                                    max_tokens=24) for i in range(4)]
        other = await chat.chat.completions.create(model=MODEL, messages=ASK, temperature=0.8, seed=11, max_tokens=24)
        await chat.close()
        listed = {s["id"]: s for s in d.store.list_sessions(branches=True)}
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert [c.message.content for c in four.choices] == [a.choices[0].message.content for a in alone]
    assert [c.finish_reason for c in four.choices] == [a.choices[0].finish_reason for a in alone]
    # The test can fail: the choices differ (their seeds do), and another seed draws another answer.
    assert len({c.message.content for c in four.choices}) > 1
    assert other.choices[0].message.content not in {c.message.content for c in four.choices}

    # One prefill: the prompt counted once, read by choice 0 alone; the others' prompts came from its cache.
    usage, per = four.usage, [kvd(c) for c in four.choices]
    assert usage is not None and alone[0].usage is not None
    assert usage.prompt_tokens == alone[0].usage.prompt_tokens > 0
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 0
    assert kvd(usage)["prefill_tokens"] == usage.prompt_tokens and kvd(usage)["choices"] == 4
    assert [p["prefill_tokens"] for p in per] == [usage.prompt_tokens, 0, 0, 0]
    assert [p["cached_tokens"] for p in per] == [0, *[usage.prompt_tokens] * 3]
    assert usage.completion_tokens == sum(p["completion_tokens"] for p in per) > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert moved == (usage.prompt_tokens, usage.completion_tokens)  # /metrics: the prompt read once

    # Each choice is kept in a session of its own: the request's, and a branch of it for each other choice.
    sessions = [p["session"] for p in per]
    assert sessions[0] == kvd(four)["session"] and len(set(sessions)) == 4
    assert all(listed[s]["branch_of"] == sessions[0] for s in sessions[1:]), [listed[s] for s in sessions]
    assert all(p["finish_reason"] in ("stop", "length") for p in per)


async def test_greedy_choices_are_the_answer_alone(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model=MODEL) as d:
        chat = api(d)
        two = await chat.chat.completions.create(model=MODEL, messages=ASK, n=2, temperature=0, max_tokens=24)
        alone = await chat.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=24)
        await chat.close()
    assert len(two.choices) == 2 and two.choices[0].message.content
    assert two.choices[0].message.content == two.choices[1].message.content == alone.choices[0].message.content


async def test_streamed_choices_reassemble_to_the_whole_response(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model=MODEL) as d:
        chat = api(d)
        asked: dict[str, Any] = {"model": MODEL, "messages": ASK, "n": 3, "temperature": 0.9, "seed": 3,
                                 "max_tokens": 20}
        whole = await chat.chat.completions.create(**asked)
        stream = await chat.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        await chat.close()
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    roles = []
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.delta.role is not None:
                roles.append(c.index)
            if c.finish_reason is not None:
                assert c.index not in finished  # each choice ends once
                finished[c.index] = c.finish_reason
    assert sorted(roles) == [0, 1, 2]
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finished == {c.index: c.finish_reason for c in whole.choices}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens,
                                                               whole.usage.completion_tokens)


async def test_a_bad_n_is_refused_and_nothing_is_stored(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model=MODEL) as d:
        async with httpx.AsyncClient(base_url=base(d), headers={"Authorization": f"Bearer {d.token}"}) as http:
            for path, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "Hi"})):
                for n, says in ((0, "greater than or equal to 1"), (100, "at most 8 choices"),
                                ("2", "valid integer"), (9, "limits.max_generations")):
                    r = await http.post(path, json={**body, "n": n, "max_tokens": 4})
                    error = r.json()["error"]
                    assert r.status_code == 400 and error["param"] == "n", (path, n, r.text)
                    assert says in error["message"], (path, n, r.text)
        assert d.store.list_sessions() == []


async def test_a_next_turn_goes_on_from_the_choice_it_continues(tmp_path: Path) -> None:
    """Going on from choice 0 continues the request's session; from another choice, that choice's session. Either
    way the next turn restores the first one's prompt from the session's own cache and reads only what is new."""
    async with running_daemon(tmp_path, model=MODEL) as d:
        chat = api(d)
        three = await chat.chat.completions.create(model=MODEL, messages=ASK, n=3, temperature=0.8, seed=5,
                                                   max_tokens=16)
        assert three.usage is not None
        first = three.usage.prompt_tokens
        for k in (0, 2):
            went_on = [*ASK, {"role": "assistant", "content": three.choices[k].message.content},
                       {"role": "user", "content": "And then?"}]
            raw = await chat.chat.completions.with_raw_response.create(model=MODEL, messages=went_on, temperature=0,
                                                                       max_tokens=8)
            nxt = raw.parse()
            assert raw.headers["x-kvd-session"] == kvd(three.choices[k])["session"]
            assert nxt.usage is not None and nxt.usage.prompt_tokens_details is not None
            cached = nxt.usage.prompt_tokens_details.cached_tokens or 0
            assert first - 1 <= cached < nxt.usage.prompt_tokens and kvd(nxt)["restored_from"] == "resident"
        await chat.close()


async def test_closing_the_stream_stops_every_choice(tmp_path: Path) -> None:
    # builtin:tiny's greedy answer to this runs to max_tokens (4,000 tokens), as tests/test_openai.py's close test.
    async with running_daemon(tmp_path, model=MODEL) as d:
        chat = api(d)
        stream = await chat.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 1000, one number per line."}],
            n=3, stream=True, temperature=0, max_tokens=4000)
        seen: set[int] = set()
        async for chunk in stream:
            seen |= {c.index for c in chunk.choices if c.delta.content}
            if seen == {0, 1, 2}:
                break
        await stream.close()
        await chat.close()
        # Read on the transcript writer, after what it was given (the loop never touches SQLite while kvd serves).
        listed = await d.daemon.turns.transcripts.writer.run(lambda store: store.list_sessions(), durable=False)
        sessions = [s["id"] for s in listed]
        assert len(sessions) == 3
        async with client(d) as c:
            for sid in sessions:
                if (await c.request("chat.attach", session=sid))["generating"]:  # still winding down
                    while (event := await c.recv())["type"] != "chat.done":
                        pass
                    assert event["finish_reason"] == "cancelled"
                kept = (await c.request("session.get", session=sid))["messages"][-1]
                assert kept["status"] == "cancelled" and kept["usage"]["completion_tokens"] < 4000, kept


async def test_text_completions_draw_n_choices(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model=MODEL) as d:
        chat = api(d)
        asked: dict[str, Any] = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0.8,
                                 "max_tokens": 8, "echo": True, "logprobs": 2}
        three = await chat.completions.create(n=3, seed=1, **asked)
        alone = [await chat.completions.create(seed=1 + i, **asked) for i in range(3)]
        await chat.close()
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.text for c in three.choices] == [a.choices[0].text for a in alone]
    assert all(c.text.startswith("The capital of France is") for c in three.choices)
    for c, a in zip(three.choices, alone):  # the prompt's and the answer's log-probabilities, per choice
        assert c.logprobs is not None and a.choices[0].logprobs is not None
        assert c.logprobs.tokens == a.choices[0].logprobs.tokens
    assert three.usage is not None and alone[0].usage is not None
    assert three.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert three.usage.completion_tokens == sum(kvd(c)["completion_tokens"] for c in three.choices)
