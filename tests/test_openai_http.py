"""The HTTP door's guards and bad input: every refusal is an OpenAI-shaped error, and kvd keeps serving."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from conftest import RunningDaemon, client, running_daemon
from daemon.engine.jobs import Done
from daemon.engine.running import Answer

pytestmark = pytest.mark.anyio

HI = {"model": "builtin:tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


class HeldEnds:
    """Every answer's end (the engine's Done) held back until released: an answer stays under way."""

    def __init__(self, d: RunningDaemon) -> None:
        self._held: list[tuple[Callable[[Any], None], Done]] = []
        self._released = False
        self._lock = threading.Lock()
        submit = d.daemon.engine.submit

        def submit_holding(answer: Answer) -> None:
            answer.emit = _Holding(self, answer.emit)
            submit(answer)

        d.daemon.engine.submit = submit_holding  # type: ignore[method-assign]

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        with self._lock:
            self._released, held, self._held = True, self._held, []
        for emit, event in held:
            emit(event)


class _Holding:
    """An answer's sink that holds its Done back: heard on the turn's event loop, as the turn core's own
    sink is (engine/handoff.py hands each step's events to the sink's `loop`)."""

    def __init__(self, ends: HeldEnds, emit: Callable[[Any], None]) -> None:
        self.ends, self.emit = ends, emit
        self.loop = getattr(emit, "loop", None)

    def __call__(self, event: Any) -> None:
        with self.ends._lock:
            if isinstance(event, Done) and not self.ends._released:
                self.ends._held.append((self.emit, event))
                return
        self.emit(event)


def http(d: RunningDaemon, **headers: str) -> httpx.AsyncClient:
    base = d.url.replace("ws://", "http://").removesuffix("/v1")
    return httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {d.token}", **headers}, timeout=60)


def assert_error(r: httpx.Response, status: int, *, says: str, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert says in error["message"], error
    if param is not None:
        assert error["param"] == param, error


async def still_serving(d: RunningDaemon) -> None:
    async with http(d) as h:
        r = await h.post("/v1/chat/completions", json=HI)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(
    "headers, status, says",
    [
        ({"Authorization": ""}, 401, "token"),
        ({"Authorization": "Bearer wrong"}, 401, "token"),
        ({"Authorization": "Basic abc"}, 401, "token"),
        ({"Origin": "http://evil.example"}, 403, "allowed_origins"),
        ({"Host": "evil.example"}, 403, "allowed_hosts"),
        ({"Host": "evil.example:8765"}, 403, "allowed_hosts"),
        ({"Host": "127.0.0.1.evil.example"}, 403, "allowed_hosts"),
    ],
)
async def test_http_refusals(tmp_path: Path, headers: dict[str, str], status: int, says: str) -> None:
    async with running_daemon(tmp_path) as d:
        async with http(d, **headers) as h:
            for r in (await h.get("/v1/models"), await h.post("/v1/chat/completions", json=HI)):
                assert_error(r, status, says=says)
        await still_serving(d)


async def test_the_root_answers_a_probe_without_the_token_and_nothing_else_does(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Claude Code sends `HEAD /` without a key before each run: it was a 401, and a token refusal in kvd's
    log every run. The root says that kvd runs (as llama-server's and Ollama's do), nothing more."""
    async with running_daemon(tmp_path) as d:
        base = d.url.replace("ws://", "http://").removesuffix("/v1")
        async with httpx.AsyncClient(base_url=base, timeout=60) as h:  # no token
            head, got = await h.head("/"), await h.get("/?probe=1")
            assert not [r for r in caplog.records if "refused" in r.getMessage()]
            assert (head.status_code, head.content) == (200, b"")
            assert (got.status_code, got.text) == (200, "kvd is running\n")
            for r in (await h.post("/"), await h.get("/v1/models"), await h.head("/v1/models"), await h.get("/v1/"),
                      await h.post("/v1/responses", json={}), await h.post("/v1/messages", json={})):
                assert r.status_code == 401, (r.request.method, r.request.url, r.text)
            # The Host and Origin checks still hold: a page on a rebound domain is refused here too.
            assert (await h.get("/", headers={"Host": "evil.example"})).status_code == 403
            assert (await h.head("/", headers={"Origin": "http://evil.example"})).status_code == 403
        await still_serving(d)


async def test_loopback_and_configured_hosts_are_allowed(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, allowed_hosts=["kvd.example"]) as d:
        port = d.url.split(":")[2].split("/")[0]
        for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", "[::1]:80", "kvd.example", "KVD.example:1"):
            async with http(d, Host=host) as h:
                assert (await h.get("/v1/models")).status_code == 200, host


async def test_websocket_handshake_checks_the_host_too(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        port = int(d.url.split(":")[2].split("/")[0])
        with pytest.raises(InvalidStatus) as info:
            # The URL names the rebound domain (so it is the Host header); the socket goes to loopback.
            async with connect(f"ws://evil.example:{port}/v1", host="127.0.0.1", port=port,
                               additional_headers={"Authorization": f"Bearer {d.token}"}):
                pass
        assert info.value.response.status_code == 403
        assert b"allowed_hosts" in info.value.response.body
        async with client(d) as c:
            assert (await c.request("ping"))["type"] == "pong"


BAD: list[tuple[Any, int, str, str | None]] = [
    (b"not json", 400, "not valid JSON", None),
    (b"\xff\xfe", 400, "not valid JSON", None),
    ([1, 2], 400, "JSON object", None),
    ({}, 400, "messages", "messages"),
    ({"messages": []}, 400, "at least 1", "messages"),
    ({"messages": "hi"}, 400, "valid list", "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "'system', 'developer', 'user', 'assistant' or 'tool'",
     "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "a tool result without tool_call_id",
     "messages[0].tool_call_id"),
    ({"messages": [{"role": "user"}]}, 400, "content is null; only an assistant's may be", "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "kvd serves text models", "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400, "'text'", None),
    ({"messages": [{"role": "system", "content": "only a system prompt"}]}, 400, "no user or assistant", "messages"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}, 400,
     "only before the conversation", "messages[1].role"),
    ({**HI, "model": "gpt-4o"}, 404, "kvd cannot serve a model named 'gpt-4o'", "model"),
    ({**HI, "response_format": {"type": "yaml"}}, 400, "'text', 'json_object' or 'json_schema'",
     "response_format.type"),
    ({**HI, "max_tokens": "5"}, 400, "valid integer", "max_tokens"),
    ({**HI, "max_tokens": True}, 400, "valid integer", "max_tokens"),
    ({**HI, "max_tokens": 0}, 400, "greater than or equal to 1", "max_tokens"),
    ({**HI, "max_completion_tokens": 0}, 400, "greater than or equal to 1", "max_completion_tokens"),
    ({**HI, "tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "not among tools", "tool_choice.function.name"),
    ({**HI, "temperature": 3}, 400, "less than or equal to 2", "temperature"),
    ({**HI, "top_p": 0}, 400, "greater than 0", "top_p"),
    ({**HI, "stream": "yes"}, 400, "valid boolean", "stream"),
    ({**HI, "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4", "stop"),
    ({**HI, "n": 9}, 400, "at most 8 choices", "n"),
    ({**HI, "n": 0}, 400, "greater than or equal to 1", "n"),
    ({**HI, "top_logprobs": 2}, 400, "logprobs", "top_logprobs"),
    ({**HI, "logprobs": True, "top_logprobs": 21}, 400, "less than or equal to 20", "top_logprobs"),
    ({**HI, "logit_bias": {"x": 1}}, 400, "not a token id", "logit_bias"),
    ({**HI, "logit_bias": {"5": 101}}, 400, "less than or equal to 100", "logit_bias"),
    ({**HI, "logit_bias": {"999999999": 1}}, 400, "vocabulary", "logit_bias"),
    ({**HI, "top_k": -1}, 400, "greater than or equal to 0", "top_k"),
    ({**HI, "min_p": 2}, 400, "less than or equal to 1", "min_p"),
    ({**HI, "frequency_penalty": 3}, 400, "less than or equal to 2", "frequency_penalty"),
    ({**HI, "repetition_penalty": 0}, 400, "greater than 0", "repetition_penalty"),
]


async def test_bad_bodies_are_clear_errors_and_lose_nothing(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, max_message_bytes=4096) as d:
        async with http(d) as h:
            for body, status, says, param in BAD:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                r = await h.post("/v1/chat/completions", content=content,
                                 headers={"Content-Type": "application/json"})
                assert_error(r, status, says=says, param=param)
            r = await h.post("/v1/chat/completions", json={**HI, "messages": [
                {"role": "user", "content": "x" * 5000}]})
            assert_error(r, 413, says="max_message_bytes")
            assert_error(await h.get("/v1/nothing"), 404, says="/v1/chat/completions")
            assert_error(await h.get("/v1/chat/completions"), 405, says="GET")
            r = await h.post("/v1/chat/completions", json=HI, headers={"X-Kvd-Session": "../etc"})
            assert_error(r, 400, says="session id", param="X-Kvd-Session")
            r = await h.post("/v1/chat/completions", json=HI, headers={"X-Kvd-Session": "0123456789abcdef"})
            assert_error(r, 404, says="no session")
        assert d.store.list_sessions() == []  # nothing was stored by any of them
        await still_serving(d)


async def test_a_refusal_by_the_engine_stores_nothing_of_the_session_it_would_have_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine refuses a new conversation too long for the model: its session was never written (not
    written and deleted); a pinned session's refused turn is taken back, its earlier messages kept."""
    from sessions import Store

    made: list[str | None] = []
    create = Store.create_session

    def recorded(self: Store, **fields: Any) -> Any:
        made.append(fields.get("session_id"))
        return create(self, **fields)

    monkeypatch.setattr(Store, "create_session", recorded)
    async with running_daemon(tmp_path, max_message_bytes=1 << 22, max_text_chars=1 << 20) as d:
        async with http(d) as h:
            long = {**HI, "messages": [{"role": "user", "content": "word " * 40000}]}
            for stream in (False, True):
                r = await h.post("/v1/chat/completions", json={**long, "stream": stream})
                assert r.json()["error"]["code"] == "context_length_exceeded"
            assert made == [] and d.store.list_sessions() == []
            r = await h.post("/v1/chat/completions", json=HI)
            sid = r.headers["X-Kvd-Session"]
            assert r.status_code == 200 and made == [sid]
            said = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}]
            r = await h.post("/v1/chat/completions", headers={"X-Kvd-Session": sid},
                             json={**HI, "messages": [*said, {"role": "user", "content": "word " * 40000}]})
            assert r.json()["error"]["code"] == "context_length_exceeded"
            assert [m["role"] for m in d.store.messages(sid)] == ["user", "assistant"] and made == [sid]
        await still_serving(d)


async def test_a_conversation_too_long_for_the_model_is_a_400_and_is_not_kept(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, max_message_bytes=1 << 22, max_text_chars=1 << 20) as d:
        async with http(d) as h:
            long = {**HI, "messages": [{"role": "user", "content": "word " * 40000}]}
            for stream in (False, True):
                r = await h.post("/v1/chat/completions", json={**long, "stream": stream})
                assert_error(r, 400, says="context")
                assert r.json()["error"]["code"] == "context_length_exceeded"
        await still_serving(d)


async def test_a_message_longer_than_max_text_chars_is_refused_as_on_the_websocket(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, max_text_chars=100) as d:
        async with http(d) as h:
            for messages in ([{"role": "user", "content": "x" * 101}],
                             [{"role": "system", "content": "s" * 101}, {"role": "user", "content": "hi"}]):
                r = await h.post("/v1/chat/completions", json={**HI, "messages": messages})
                assert_error(r, 400, says="longer than 100 characters")
                assert r.json()["error"]["code"] == "string_above_max_length"
            r = await h.post("/v1/chat/completions", json={**HI, "messages": [{"role": "user", "content": "x" * 100}],
                                                            "max_tokens": 1})
            assert r.status_code == 200
        await still_serving(d)


async def test_stop_sequences_end_the_answer_and_the_kept_text(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with http(d) as h:
            ask = {**HI, "max_tokens": 40}
            whole = (await h.post("/v1/chat/completions", json=ask)).json()["choices"][0]["message"]["content"]
            words = whole.split()
            stop = words[3]
            cut = whole[:whole.index(stop)]
            for stream in (False, True):
                r = await h.post("/v1/chat/completions", json={**ask, "stop": [stop, "never seen"], "stream": stream})
                if stream:
                    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                              if line.startswith("data: {")]
                    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
                    finish = chunks[-1]["choices"][0]["finish_reason"]
                    assert r.text.rstrip().endswith("data: [DONE]")
                else:
                    text = r.json()["choices"][0]["message"]["content"]
                    finish = r.json()["choices"][0]["finish_reason"]
                assert (text, finish) == (cut, "stop")
                kept = d.store.messages(r.headers["X-Kvd-Session"])[-1]
                assert (kept["content"], kept["finish_reason"], kept["status"]) == (cut, "stop", "complete")


async def test_a_pinned_session_is_continued_and_rewound_only_when_asked(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = (await c.request("session.create", title="From kvchat", system="Be brief."))["session"]["id"]
            for text in ("hello from kvchat", "and a second turn"):
                _, done = await c.chat(sid, text, max_tokens=4, temperature=0)
                assert done["type"] == "chat.done"
        async with http(d, **{"X-Kvd-Session": sid}) as h:
            # What a client must send to continue it: the session's transcript, read-only.
            held = (await h.get(f"/v1/kvd/sessions/{sid}")).json()
            stored = [{"role": "system", "content": "Be brief."}] + [
                {"role": m["role"], "content": m["content"]} for m in d.store.messages(sid)]
            assert held["id"] == sid and held["messages"] == stored
            assert_error(await h.get("/v1/kvd/sessions/0123456789abcdef"), 404, says="no session")
            more = [*held["messages"], {"role": "user", "content": "and now?"}]
            r = await h.post("/v1/chat/completions", json={**HI, "messages": more})
            assert r.status_code == 200 and r.headers["X-Kvd-Session"] == sid
            answer = r.json()["choices"][0]["message"]["content"]
            assert [m["content"] for m in d.store.messages(sid)] == [m["content"] for m in more[1:]] + [answer]
            before = d.store.messages(sid)
            # A pinned request that would erase stored messages is refused, naming where it differs,
            # and nothing is touched: a single new message, an edited one, another system prompt.
            for messages, where in (([{"role": "user", "content": "hi"}], "messages[0]"),
                                    ([*more[:2], {"role": "user", "content": "edited"}], "messages[2]"),
                                    ([{"role": "system", "content": "Be long."}, *more[1:]], "messages[0]")):
                r = await h.post("/v1/chat/completions", json={**HI, "messages": messages})
                assert_error(r, 409, says="X-Kvd-Rewind: true", param=where)
                assert r.json()["error"]["code"] == "session_diverged"
                assert d.store.messages(sid) == before
            # Asked to, the pinned session is rewound there, as /edit does.
            rewind = {"X-Kvd-Rewind": "true"}
            brief_edit = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "edited"}]
            r = await h.post("/v1/chat/completions", json={**HI, "messages": brief_edit}, headers=rewind)
            assert r.status_code == 200
            edited = r.json()["choices"][0]["message"]["content"]
            assert [(m["role"], m["content"]) for m in d.store.messages(sid)] == [("user", "edited"),
                                                                                   ("assistant", edited)]
            # Busy: another request on the same pinned session while one is answering. builtin:tiny
            # ends this answer by itself after a few dozen tokens, which a loaded machine can take
            # longer to follow with the second request: so the answer's end waits for the check.
            ends = HeldEnds(d)
            long = {**HI, "max_tokens": 4000, "stream": True,
                    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "go on"}]}
            async with h.stream("POST", "/v1/chat/completions", json=long, headers=rewind) as streaming:
                assert streaming.status_code == 200
                async for line in streaming.aiter_lines():
                    if '"content":"' in line.replace(" ", "") and '"content":""' not in line.replace(" ", ""):
                        break  # under way
                r = await h.post("/v1/chat/completions", json=HI, headers=rewind)
                assert_error(r, 409, says="answering another request")
                ends.release()
            # Leaving the stream early cancelled that answer; the session is usable again.
            turn = d.daemon.turns.active.get(sid)
            if turn is not None:
                with anyio.fail_after(60):
                    await turn.finished.wait()
            last = d.store.messages(sid)[-1]
            # Cut short, unless the model ended it by itself before the client left (builtin:tiny may).
            assert (last["status"], last["finish_reason"]) in (("cancelled", "cancelled"), ("complete", "stop")), last
            assert (await h.post("/v1/chat/completions", json=HI, headers=rewind)).status_code == 200
        assert [s["id"] for s in d.store.list_sessions()] == [sid]  # nothing else was created


async def test_both_doors_tokenize_at_once_and_every_prompt_is_exact(tmp_path: Path) -> None:
    """Long prompts through the websocket and the HTTP door together: one tokenizer stage, no garbled ids."""
    from daemon.prompt import conversation_ids

    texts = [f"{i} " + " ".join(f"word{i * 7 + j}" for j in range(150)) for i in range(8)]
    counts: dict[str, int] = {}
    async with running_daemon(tmp_path, max_text_chars=1 << 16, max_generations=8, prefill_step_size=4096) as d:

        async def over_websocket(text: str) -> None:
            async with client(d) as c:
                sid = (await c.request("session.create"))["session"]["id"]
                _, done = await c.chat(sid, text, max_tokens=1)
                assert done["type"] == "chat.done", done
                counts[text] = done["usage"]["prompt_tokens"]

        async def over_http(text: str) -> None:
            async with http(d) as h:
                r = await h.post("/v1/chat/completions",
                                 json={**HI, "max_tokens": 1, "messages": [{"role": "user", "content": text}]})
            assert r.status_code == 200, r.text
            counts[text] = r.json()["usage"]["prompt_tokens"]

        async with anyio.create_task_group() as tg:
            for i, text in enumerate(texts):
                tg.start_soon(over_websocket if i % 2 else over_http, text)
        tokenizer = d.daemon.engine.tokenizer
        for text in texts:  # one at a time, after the fact: what each prompt must have been
            assert counts[text] == len(conversation_ids(tokenizer, [{"role": "user", "content": text}], None))



async def test_what_clients_send_is_understood(tmp_path: Path) -> None:
    """The developer role, several leading instructions, an assistant's null content, the model by id."""
    async with running_daemon(tmp_path) as d:
        async with http(d) as h:
            messages = [{"role": "developer", "content": "Be brief."}, {"role": "system", "content": "Be kind."},
                        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                        {"role": "user", "content": "and?"}]
            r = await h.post("/v1/chat/completions", json={**HI, "messages": messages,
                                                           "response_format": {"type": "text"}})
            assert r.status_code == 200, r.text
            session = d.store.get_session(r.headers["X-Kvd-Session"])
            assert session is not None and session["system"] == "Be brief.\n\nBe kind."
            assert [m["content"] for m in d.store.messages(session["id"])][:3] == ["hi", "", "and?"]
            model = (await h.get("/v1/models/builtin:tiny")).json()
            assert model["id"] == "builtin:tiny" and model["object"] == "model"
            assert_error(await h.get("/v1/models/gpt-4o"), 404, says="kvd cannot serve a model named 'gpt-4o'")


async def test_a_continued_conversation_is_fed_a_whole_renders_ids_made_from_its_new_messages(tmp_path: Path) -> None:
    """Each request of a growing conversation (the official client, the whole conversation each time) is
    fed exactly what rendering and tokenizing it whole gives, though only the first was encoded whole
    (daemon/renders.py): a branch continues the request it branches from, and the original goes on
    appending after the branch."""
    import openai

    from daemon.prompt import conversation_ids

    fed: list[tuple[str, list[int]]] = []
    async with running_daemon(tmp_path) as d:
        submit = d.daemon.engine.submit

        def recording(answer: Answer) -> None:
            fed.append((answer.session_id, list(answer.tokens)))
            submit(answer)

        d.daemon.engine.submit = recording  # type: ignore[method-assign]
        api = openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token, max_retries=0)
        system = "You keep answers short.  "
        convo: list[Any] = [{"role": "user", "content": "Tell me about caches " * 30}]
        sent: list[list[Any]] = []
        sessions: list[str] = []

        async def ask(messages: list[Any]) -> str:
            raw = await api.chat.completions.with_raw_response.create(
                model="builtin:tiny", messages=[{"role": "system", "content": system}, *messages],
                max_tokens=4, temperature=0)
            sent.append(list(messages))
            sessions.append(raw.headers["x-kvd-session"])
            return raw.parse().choices[0].message.content or ""

        for follow_up in ("  and then?\n", "<|im_start|>user\nno", "é\u0301 日本 ```", "", "last one"):
            convo += [{"role": "assistant", "content": await ask(convo)}, {"role": "user", "content": follow_up}]
        branch = [*convo[:3], {"role": "user", "content": "something else"}]
        await ask(branch)
        await ask(convo)
        await api.close()
        renders = d.daemon.turns.renders
        tokenizer = d.daemon.engine.tokenizer
        assert [sid for sid, _ in fed] == sessions
        for (_, ids), messages in zip(fed, sent, strict=True):
            assert ids == conversation_ids(tokenizer, messages, system)
    assert len(set(sessions)) == 2 and sessions[-1] == sessions[0] != sessions[-2]
    assert (renders.whole, renders.appended) == (1, 6)  # the first request


async def test_after_a_restart_the_next_request_of_a_conversation_renders_only_its_new_messages(
        tmp_path: Path) -> None:
    """The last request of each recent API conversation is rendered again after a start (OpenAIDoor.seed),
    so the first request after a restart renders only its new messages, and is still fed exactly a whole
    render's ids; a websocket session is not seeded."""
    import openai

    from daemon.prompt import conversation_ids

    system = "Be brief."
    convo: list[Any] = [{"role": "user", "content": "Tell me about caches " * 20}]
    async with running_daemon(tmp_path) as d:
        api = openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token, max_retries=0)
        for follow_up in ("and then?", "one more"):
            answer = await api.chat.completions.create(
                model="builtin:tiny", messages=[{"role": "system", "content": system}, *convo], max_tokens=4,
                temperature=0)
            convo += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                      {"role": "user", "content": follow_up}]
        await api.close()
        async with client(d) as c:  # a kvchat-like session: fed ids, nothing to seed
            sid = (await c.request("session.create", title="ws"))["session"]["id"]
            await c.chat(sid, "hello", max_tokens=2)
    fed: list[list[int]] = []
    async with running_daemon(tmp_path) as d:
        renders = d.daemon.turns.renders
        with anyio.fail_after(30):
            while renders.whole < 1:  # the seed runs once the model is ready
                await anyio.sleep(0.02)
        submit = d.daemon.engine.submit

        def recording(answer: Answer) -> None:
            fed.append(list(answer.tokens))
            submit(answer)

        d.daemon.engine.submit = recording  # type: ignore[method-assign]
        api = openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token, max_retries=0)
        raw = await api.chat.completions.with_raw_response.create(
            model="builtin:tiny", messages=[{"role": "system", "content": system}, *convo], max_tokens=4,
            temperature=0)
        await api.close()
        assert raw.headers["x-kvd-session"] != sid
        assert (renders.whole, renders.appended) == (1, 1)  # the seed, then only the new messages
        assert fed == [conversation_ids(d.daemon.engine.tokenizer, convo, system)]


async def test_a_seed_that_cannot_read_the_transcripts_is_one_warning_and_kvd_serves_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with running_daemon(tmp_path) as d:
        async def unreadable(fn: Any) -> Any:
            raise OSError("disk I/O error")

        read = d.daemon.turns.transcripts.read
        d.daemon.turns.transcripts.read = unreadable  # type: ignore[method-assign]
        assert await d.daemon.api.seed() == 0
        d.daemon.turns.transcripts.read = read  # type: ignore[method-assign]
        assert any("could not render the recent API conversations ahead" in r.getMessage() and "disk I/O error"
                   in r.getMessage() for r in caplog.records)
        await still_serving(d)
