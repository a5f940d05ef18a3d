"""Many models, one daemon: builtin:tiny and builtin:tiny-swa served by one kvd, by name, with no restart.

A real daemon on a real port (this process), the websocket protocol and the
official `openai` client. Each model's answers must be exactly those of a
daemon serving only that model; a budget that fits one model unloads the idle
other; a model that can never fit is refused in one line; and the fields that
`kvd ps`, `/v1/models` and the session list show are all there.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from conftest import Client, RunningDaemon, client, running_daemon
from daemon.models.footprint import weights_bytes
from daemon.models.sources import prepare_model

pytestmark = pytest.mark.anyio

TINY, SWA = "builtin:tiny", "builtin:tiny-swa"
GREEDY = {"temperature": 0.0, "max_tokens": 12}
PROMPTS = ["Hello there, who are you?", "Tell me about caches.", "And once more?"]
MODEL_FIELDS = {"model", "default", "state", "weights_bytes", "context_length", "idle_s", "unloads_in_s", "device",
                "cache"}
V1_MODEL_FIELDS = {"id", "object", "created", "owned_by", "context_length", "max_model_len", "max_context_length",
                   "loaded_context_length", "state"}


async def turn(c: Client, session: str, text: str, **fields: Any) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """One chat.send: its text, its closing event, and the daemon events (`loading`, `ready`) seen meanwhile."""
    await c.send({"id": "t", "type": "chat.send", "session": session, "text": text, **GREEDY, **fields})
    out, daemon_events = "", []
    while True:
        event = await c.recv()
        if event.get("id") is None:
            daemon_events.append(event)
        elif event["type"] == "chat.delta":
            out += event["text"]
        elif event["type"] in ("chat.done", "error"):
            return out, event, daemon_events


def api(d: RunningDaemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://").removesuffix("/v1") + "/v1",
                              api_key=d.token, max_retries=0)


async def answers_alone(data_dir: Path, model: str) -> tuple[list[str], list[str]]:
    """What a daemon serving only `model` answers: the websocket conversation's and the API's."""
    async with running_daemon(data_dir, model=model) as d, client(d) as c:
        session = (await c.request("session.create"))["session"]["id"]
        ws = [(await turn(c, session, text))[0] for text in PROMPTS]
        http = []
        history: list[dict[str, str]] = []
        for text in PROMPTS:
            history.append({"role": "user", "content": text})
            r = await api(d).chat.completions.create(model="kvd", messages=history,  # type: ignore[arg-type]
                                                    temperature=0.0, max_tokens=12)
            history.append({"role": "assistant", "content": r.choices[0].message.content or ""})
            http.append(r.choices[0].message.content or "")
        return ws, http


async def test_two_models_alternate_across_two_doors_and_answer_as_alone(tmp_path: Path) -> None:
    alone = {m: await answers_alone(tmp_path / m.replace(":", "-"), m) for m in (TINY, SWA)}
    async with running_daemon(tmp_path / "both", model=TINY) as d, client(d) as c:
        sessions = {m: (await c.request("session.create", model=m))["session"] for m in (TINY, SWA)}
        assert {m: s["model"] for m, s in sessions.items()} == {TINY: TINY, SWA: SWA}
        history: dict[str, list[dict[str, str]]] = {TINY: [], SWA: []}
        got: dict[str, tuple[list[str], list[str]]] = {TINY: ([], []), SWA: ([], [])}
        loads: list[dict[str, Any]] = []
        for text in PROMPTS:
            for m in (SWA, TINY):  # the websocket and the API take turns, each on both models
                said, done, seen = await turn(c, sessions[m]["id"], text)
                assert done["type"] == "chat.done", done
                loads += seen
                got[m][0].append(said)
                history[m].append({"role": "user", "content": text})
                r = await api(d).chat.completions.create(model=m, messages=history[m],  # type: ignore[arg-type]
                                                        temperature=0.0, max_tokens=12)
                assert r.model == m
                history[m].append({"role": "assistant", "content": r.choices[0].message.content or ""})
                got[m][1].append(r.choices[0].message.content or "")
        assert got == alone
        # The second model was loaded on first use, with a `loading` event naming it, then `ready`.
        assert [e["type"] for e in loads][-1] == "ready" and all(e.get("model") == SWA for e in loads)

        status = (await c.request("status"))
        loaded = {m["model"]: m for m in status["models"]}
        assert set(loaded) == {TINY, SWA}
        for m in loaded.values():
            assert set(m) == MODEL_FIELDS
            assert m["state"] == "idle" and m["weights_bytes"] > 0 and m["context_length"] == 8192
        assert loaded[TINY]["default"] and not loaded[SWA]["default"]
        # What each model's cache keeps: plain KV alone, or a window beside it (its checkpoints' bytes then).
        assert loaded[TINY]["cache"]["kinds"] == {"kv": 4} and loaded[TINY]["cache"]["checkpoint_bytes"] == 0
        swa = loaded[SWA]["cache"]
        assert swa["kinds"] == {"rotating": 2, "kv": 2} and swa["checkpoint_bytes"] > 0

        listed = (await c.request("session.list"))["sessions"]
        shown = {s["id"]: s["model"] for s in listed}
        assert shown[sessions[TINY]["id"]] == TINY and shown[sessions[SWA]["id"]] == SWA
        assert all("model" in s for s in listed)  # the API's sessions too

        models = (await api(d).models.list()).model_dump()["data"]
        assert [m["id"] for m in models][0] == TINY  # the default first
        by_id = {m["id"]: m for m in models}
        assert {TINY, SWA} <= set(by_id)
        for m in (TINY, SWA):
            assert set(by_id[m]) >= V1_MODEL_FIELDS
            assert by_id[m]["context_length"] == by_id[m]["max_model_len"] == 8192 and by_id[m]["state"] == "loaded"


async def test_a_session_switched_to_another_model_retokenizes_and_records_it(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model=TINY) as d, client(d) as c:
        session = (await c.request("session.create"))["session"]
        assert session["model"] == TINY  # a session that names none: the default's
        _, done, _ = await turn(c, session["id"], "first")
        assert done["type"] == "chat.done"
        # A status is answered once tiny's queued writes are done: `kept_for` is read from the disk index.
        await c.request("status")
        _, done, _ = await turn(c, session["id"], "second", model="tiny-swa")  # a name without its prefix
        assert done["type"] == "chat.done"
        usage = done["usage"]  # no cache for this model, and it says which model keeps one
        assert (usage["restored_from"], usage["model"], usage["kept_for"]) == ("none", SWA, [TINY])
        got = (await c.request("session.get", session=session["id"]))["session"]
        assert got["model"] == SWA
        _, done, _ = await turn(c, session["id"], "third")  # the session's model from now on
        assert done["type"] == "chat.done" and done["usage"]["restored_from"] != "none"
        _, done, _ = await turn(c, session["id"], "back", model=TINY)  # tiny's cache was kept meanwhile
        assert done["type"] == "chat.done" and done["usage"]["restored_from"] != "none", done["usage"]


async def test_names_kvd_cannot_serve_are_refused_clearly(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model=TINY) as d, client(d) as c:
        refused = await c.request("session.create", model="no-such-model")
        assert refused["type"] == "error" and refused["code"] == "unknown_model"
        assert "kvd models" in refused["message"]
        session = (await c.request("session.create"))["session"]["id"]
        _, done, _ = await turn(c, session, "hi", model="no-such-model")
        assert done["type"] == "error" and done["code"] == "unknown_model"
        with pytest.raises(openai.NotFoundError) as e:
            await api(d).chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
        assert e.value.code == "model_not_found"
        assert (await c.request("session.get", session=session))["messages"] == []  # nothing stored


def sizes(tmp_path: Path) -> dict[str, int]:
    return {m: weights_bytes(prepare_model(m, tmp_path / "sizes"), "float32") for m in (TINY, SWA)}


async def test_a_budget_for_one_model_unloads_the_idle_other(tmp_path: Path) -> None:
    size = sizes(tmp_path)
    async with running_daemon(tmp_path / "d", model=TINY, models_memory=max(size.values()) + 1000) as d, \
            client(d) as c:
        session = (await c.request("session.create", model=SWA))["session"]["id"]
        _, done, _ = await turn(c, session, "hi")
        assert done["type"] == "chat.done", done
        assert [m["model"] for m in (await c.request("status"))["models"]] == [SWA]  # the idle default went
        default = (await c.request("session.create"))["session"]["id"]
        _, done, _ = await turn(c, default, "and back")  # the default again: it unloads tiny-swa
        assert done["type"] == "chat.done", done
        assert [m["model"] for m in (await c.request("status"))["models"]] == [TINY]


async def test_a_model_that_can_never_fit_is_refused_in_one_line(tmp_path: Path) -> None:
    size = sizes(tmp_path)
    async with running_daemon(tmp_path / "d", model=TINY, models_memory=size[SWA] - 1000) as d, client(d) as c:
        session = (await c.request("session.create", model=SWA))["session"]["id"]
        _, done, _ = await turn(c, session, "hi")
        assert done["type"] == "error" and done["code"] == "too_large", done
        line = done["message"]
        assert "\n" not in line and line.startswith(f"{SWA} needs 4.7 MiB for its weights and the models may take")
        assert (await c.request("session.get", session=session))["messages"] == []  # taken back
        with pytest.raises(openai.APIStatusError) as e:
            await api(d).chat.completions.create(model=SWA, messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 503 and SWA in json.dumps(e.value.body)
        with anyio.fail_after(30):  # the default still answers
            _, done, _ = await turn(c, (await c.request("session.create"))["session"]["id"], "still here?")
        assert done["type"] == "chat.done"
        kept = (await c.request("session.create"))["session"]["id"]
        await turn(c, kept, "first")
        _, done, _ = await turn(c, kept, "on tiny-swa?", model=SWA)  # refused: the session keeps its model
        assert done["code"] == "too_large"
        got = await c.request("session.get", session=kept)
        assert got["session"]["model"] == TINY and len(got["messages"]) == 2
        _, done, _ = await turn(c, kept, "and on")
        assert done["type"] == "chat.done" and done["usage"]["restored_from"] != "none"


async def test_a_switch_to_a_loaded_model_says_which_model_keeps_the_cache_in_the_same_run(tmp_path: Path) -> None:
    """With both models loaded, a conversation switched to the other one in the same run said `cache none`: the
    note came from the disk index as the other model's engine read it when it loaded, before this conversation
    existed. Now from every loaded model's cache store too, on the websocket and on every HTTP door."""
    async with running_daemon(tmp_path, model=TINY) as d, client(d) as c:
        _, done, _ = await turn(c, (await c.request("session.create", model=SWA))["session"]["id"], "load it")
        assert done["type"] == "chat.done"  # both are loaded from here on
        session = (await c.request("session.create"))["session"]["id"]
        await turn(c, session, "first")
        _, done, _ = await turn(c, session, "second", model=SWA)
        usage = done["usage"]
        assert (usage["restored_from"], usage["model"], usage["kept_for"]) == ("none", SWA, [TINY]), usage
        ask: Any = [{"role": "user", "content": "An HTTP conversation."}]
        first = await api(d).chat.completions.create(model=TINY, messages=ask, max_tokens=3, temperature=0)
        ask += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "On?"}]
        second = await api(d).chat.completions.create(model=SWA, messages=ask, max_tokens=3, temperature=0)
    kvd: Any = (second.model_extra or {})["kvd"]
    assert (kvd["restored_from"], kvd["model"], kvd["kept_for"]) == ("none", SWA, [TINY]), kvd
    assert second.usage is not None and (second.usage.model_extra or {})["kvd"]["kept_for"] == [TINY]  # usage too


async def test_kvchat_model_flag_and_model_command(tmp_path: Path) -> None:
    from kvchat_harness import kvchat

    async with running_daemon(tmp_path, model=TINY) as d:
        screen = await kvchat(d, "--new", "--model", "tiny-swa", "--temperature", "0", "--max-tokens", "4", script=[
            "/model", "Hello there", "/model builtin:tiny", "/model", "And now?", "/model nonsense", "Again?",
            "/quit"])
        lines = screen.lines
        assert "model: tiny-swa; /model NAME answers from another" in lines
        assert "the next answer comes from builtin:tiny (loaded)" in lines  # the default is: not "loads it"
        assert "the next answer comes from nonsense (kvd loads it on first use)" in lines
        assert "model: builtin:tiny; /model NAME answers from another" in lines
        assert any(line.startswith("error: kvd cannot serve a model named 'nonsense'") for line in lines), lines
        sid = re.search(r"session ([0-9a-f]{16}) · model builtin:tiny-swa", screen.text).group(1)  # type: ignore[union-attr]
        async with client(d) as c:
            got = await c.request("session.get", session=sid)
        assert got["session"]["model"] == TINY
        assert [m["role"] for m in got["messages"]] == ["user", "assistant", "user", "assistant"]  # "Again?" refused


async def test_an_idle_model_is_unloaded_after_keep_alive_and_loaded_again_on_use(tmp_path: Path) -> None:
    import dataclasses

    async with running_daemon(tmp_path, model=TINY) as d, client(d) as c:
        session = (await c.request("session.create", model=SWA))["session"]["id"]
        _, done, _ = await turn(c, session, "hi")
        assert done["type"] == "chat.done"
        engines = d.daemon.engines
        assert await engines.expire() == []  # idle for less than keep_alive (300 s)
        engines.config = dataclasses.replace(engines.config, keep_alive=1e-9)
        assert await engines.expire() == [SWA]  # the default is never unloaded by keep_alive
        assert [m["model"] for m in (await c.request("status"))["models"]] == [TINY]
        _, done, _ = await turn(c, session, "again")  # loaded again, and its cache was kept on disk
        assert done["type"] == "chat.done" and done["usage"]["restored_from"] == "disk", done["usage"]


async def test_loading_a_model_never_stops_another_models_answer(tmp_path: Path) -> None:
    """A long answer on the default streams on while another model loads and answers beside it, and both
    answers are the ones each model gives alone (one engine thread per model: MLX on two threads at once)."""
    long = {"temperature": 0.0, "max_tokens": 48}
    alone: dict[str, str] = {}
    for m in (TINY, SWA):
        async with running_daemon(tmp_path / f"alone-{m[-4:]}", model=m) as d, client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            alone[m] = (await turn(c, sid, "Tell me a long story.", **long))[0]
    async with running_daemon(tmp_path / "both", model=TINY) as d, client(d) as a, client(d) as b:
        first = (await a.request("session.create"))["session"]["id"]
        other = (await b.request("session.create", model=SWA))["session"]["id"]
        await a.send({"id": "long", "type": "chat.send", "session": first, "text": "Tell me a long story.", **long})
        while (await a.recv())["type"] != "chat.delta":
            pass  # the default is answering
        got: dict[str, str] = {}

        async def on_default() -> None:
            text = ""
            while (e := await a.recv())["type"] != "chat.done":
                if e.get("id") == "long" and e["type"] == "chat.delta":
                    text += e["text"]
            got[TINY] = text

        async with anyio.create_task_group() as tg:
            tg.start_soon(on_default)
            said, done, _ = await turn(b, other, "Tell me a long story.", **long)  # loads tiny-swa meanwhile
            assert done["type"] == "chat.done"
            got[SWA] = said
        assert got[SWA] == alone[SWA] and alone[TINY].endswith(got[TINY])  # the default's first delta was read above


async def test_a_window_models_warm_cache_keeps_its_blocks_through_an_unload(tmp_path: Path) -> None:
    """Issue 51: a sliding-window model unloaded by keep_alive while its conversation's cache was warm
    (other models' caches fill the budgets every model shares; here none may stay resident) paged that
    warm snapshot out again, whole: one file from token 0, in place of the blocks and the turns' files disk
    held already. A window cannot be cut short of a file's end, so what a turn restores short of the
    cache's end (a regenerate here; the OpenAI door, whose new render of an answer parts from the ids drawn)
    then found nothing at all. The regenerate restores turn one, as it does without the unload."""
    import dataclasses

    async with running_daemon(tmp_path, model=TINY, max_resident_sessions=0) as d, client(d) as c:
        session = (await c.request("session.create", model=SWA))["session"]["id"]
        _, one, _ = await turn(c, session, "Tell me about the weather, the sea and the hills. " * 12)
        _, two, _ = await turn(c, session, "And then?")
        assert one["type"] == two["type"] == "chat.done" and two["usage"]["restored_from"] == "warm", two
        turn_one = one["usage"]["prompt_tokens"] + one["usage"]["completion_tokens"] - 1  # the last drawn: unfed
        assert turn_one > 2 * 128  # its prefill crossed block boundaries: blocks on disk, then its own file
        engines = d.daemon.engines
        engines.config = dataclasses.replace(engines.config, keep_alive=1e-9)
        assert await engines.expire() == [SWA]  # its caches paged out: disk holds them already
        await c.send({"id": "regen", "type": "chat.regenerate", "session": session, **GREEDY})
        while (regen := await c.recv())["type"] not in ("chat.done", "error"):
            pass
        assert regen["type"] == "chat.done", regen
        assert regen["usage"]["prompt_tokens"] == two["usage"]["prompt_tokens"]
        assert regen["usage"]["restored_from"] == "disk" and regen["usage"]["cached_tokens"] >= turn_one, regen


async def test_a_window_models_prompt_that_ends_on_a_block_end_keeps_that_block(tmp_path: Path) -> None:
    """Issue 51: a sliding window's block is taken where its prefill passes the block's end, and a prompt
    that ended exactly there took none (the capture came only while ids were left to feed), so its last
    block was lost: the next turn through the OpenAI door, whose render parts from the ids drawn after
    the prompt, restored a block short (768 of a 896-id prompt in the campaign). Here the prompt is two
    blocks and the next request's answer is another text: it restores both blocks."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from daemon.models.builtin import ensure_builtin
    from daemon.prompt import conversation_ids

    tokenizer = load_tokenizer(ensure_builtin(SWA, tmp_path / "models"))
    words = "the sea hills weather river stone light morning city road garden window story letter".split()
    said: list[str] = []
    while len(conversation_ids(tokenizer, [{"role": "user", "content": " ".join(said)}], None)) < 2 * 128:
        said.append(words[len(said) % len(words)])
    messages = [{"role": "user", "content": " ".join(said)}]
    assert len(conversation_ids(tokenizer, messages, None)) == 2 * 128  # each word one id
    async with running_daemon(tmp_path / "kvd", model=SWA) as d:
        first = await api(d).chat.completions.create(model=SWA, messages=messages,  # type: ignore[arg-type]
                                                      max_tokens=8, temperature=0)
        assert first.usage is not None and first.usage.prompt_tokens == 2 * 128
        messages += [{"role": "assistant", "content": "Another answer, not the one drawn."},
                     {"role": "user", "content": "And then?"}]
        second = await api(d).chat.completions.create(model=SWA, messages=messages,  # type: ignore[arg-type]
                                                       max_tokens=8, temperature=0)
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        assert second.usage.prompt_tokens_details.cached_tokens == 2 * 128, second.usage
