"""The official `openai` client against a real `kvd serve`: completions, streams, the cache across restarts.

Every answer is greedy on builtin:tiny (pinned here: the default model may
change), so "exact" means equal to what a fresh daemon answers to the same
messages, which feeds the whole conversation from nothing.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import openai
import pytest

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

from daemonproc import DaemonProcess

MODEL = "builtin:tiny"
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 16}


def api(d: DaemonProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.base_url, api_key=d.token, max_retries=0)


def ask(d: DaemonProcess, messages: list[dict[str, str]], **fields: Any) -> tuple[str, Any, str]:
    """One non-streaming completion: its text, its raw completion and the session kvd kept it in."""
    raw = api(d).chat.completions.with_raw_response.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                           **{**GREEDY, **fields})
    completion = raw.parse()
    return completion.choices[0].message.content or "", completion, raw.headers["x-kvd-session"]


def transcript(d: DaemonProcess, session: str) -> list[tuple[str, str, str]]:
    with d.client() as c:
        got = c.request("session.get", session=session)
    return [(m["role"], m["content"], m["status"]) for m in got["messages"]]


def fed(data_dir: Path, session: str) -> bytes:
    db = sqlite3.connect(data_dir / "kvd.sqlite")
    try:
        (blob,) = db.execute("SELECT tokens FROM session_tokens WHERE session_id = ?", [session]).fetchone()
    finally:
        db.close()
    return bytes(blob)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("kvd"), "--model", MODEL)
    with d.client():
        pass  # the model has loaded
    yield d
    assert d.terminate() == 0


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A second daemon, for reference answers: it keeps no cache in any tier, so it prefills every request whole,
    and it never speculates, so the answers it gives are plain decoding's."""
    root = tmp_path_factory.mktemp("fresh")
    config = root / "nocache.toml"
    config.write_text("[cache]\nresident_bytes = 0\nwarm_bytes = 0\ndisk_bytes = 0\n")
    d = DaemonProcess(root / "data", "--model", MODEL, "--config", str(config), "--speculate", "off")
    with d.client():
        pass
    yield d
    assert d.terminate() == 0


def fresh_answer(d: DaemonProcess, messages: list[dict[str, str]]) -> str:
    """What a daemon that never saw this conversation answers: a new session, a full prefill."""
    text, completion, _ = ask(d, messages)
    assert completion.usage.prompt_tokens_details.cached_tokens == 0, "the reference daemon reused a cache"
    return text


def test_models_list(daemon: DaemonProcess) -> None:
    models = api(daemon).models.list()
    ids = [m.id for m in models]
    assert ids[0] == MODEL and {"builtin:tiny-swa", "builtin:smollm2", "builtin:gemma3"} <= set(ids)  # all servable
    assert models.data[0].owned_by == "kvd" and (models.data[0].model_extra or {})["context_length"] == 8192


def test_completion_then_cached_second_turn_then_stream(daemon: DaemonProcess, fresh: DaemonProcess) -> None:
    first = [{"role": "system", "content": "You answer about caches."},
             {"role": "user", "content": "What is a KV cache, in a sentence or two?"}]
    a1, c1, sid = ask(daemon, first)
    assert a1 and c1.object == "chat.completion" and c1.model == MODEL
    assert c1.choices[0].finish_reason in ("stop", "length")
    assert c1.usage.prompt_tokens > 0 and c1.usage.completion_tokens > 0
    assert c1.usage.total_tokens == c1.usage.prompt_tokens + c1.usage.completion_tokens
    kvd = c1.model_extra["kvd"] if c1.model_extra else {}
    assert kvd["drafted_tokens"] >= kvd["accepted_tokens"] >= 0

    second = [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": "And why keep it?"}]
    stream = api(daemon).chat.completions.create(model=MODEL, messages=cast("list[ChatCompletionMessageParam]", second),
                                                 stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY)
    assert stream.response.headers["x-kvd-session"] == sid  # the same conversation, continued
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    # The first turn's whole prompt came from the cache (the newline after "assistant" may
    # merge with the answer's first characters when the conversation is tokenized whole).
    assert c1.usage.prompt_tokens - 1 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    # What the cache did, in the usage a streaming client gets (issue 44, item 9).
    streamed = (usage.model_extra or {})["kvd"]
    assert streamed["session"] == sid and streamed["restored_from"] not in (None, "none"), streamed
    assert streamed["shared_tokens"] == 0 and streamed["ttft_ms"] > 0
    assert streamed["finish_reason"] == chunks[-2].choices[0].finish_reason
    assert text == fresh_answer(fresh, second)

    # kvchat sees one session holding both turns.
    assert transcript(daemon, sid) == [("user", first[1]["content"], "complete"), ("assistant", a1, "complete"),
                                       ("user", "And why keep it?", "complete"), ("assistant", text, "complete")]


def test_errors_are_openai_errors(daemon: DaemonProcess) -> None:
    client = api(daemon)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=9)
    assert info.value.status_code == 400
    assert "at most 8 choices" in info.value.message and info.value.param == "n"
    with pytest.raises(openai.BadRequestError, match="kvd serves text models"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=daemon.base_url, api_key="wrong", max_retries=0).models.list()
    # Still serving.
    assert ask(daemon, [{"role": "user", "content": "still there?"}])[0]


def test_closing_a_stream_stops_the_answer_and_keeps_it(daemon: DaemonProcess) -> None:
    # builtin:tiny's greedy answer to this runs to max_tokens (4,000 tokens, seconds); to "Tell me a very long
    # story." it is 21 tokens, which on a busy machine could end by itself before the close reached the engine.
    stream = api(daemon).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 1000, one number per line."}],
        stream=True, temperature=0, max_tokens=4000)
    sid = stream.response.headers["x-kvd-session"]
    seen = ""
    for chunk in stream:
        seen += chunk.choices[0].delta.content or ""
        if len(seen) > 40:
            break
    stream.close()
    with daemon.client() as c:
        attached = c.request("chat.attach", session=sid)
        if attached["generating"]:  # still winding down: follow it to its end
            while (event := c.recv())["type"] != "chat.done":
                pass
            assert event["finish_reason"] == "cancelled"
        kept = c.request("session.get", session=sid)["messages"][-1]
    assert kept["status"] == "cancelled" and kept["finish_reason"] == "cancelled"
    assert kept["content"].startswith(seen)
    assert kept["usage"]["completion_tokens"] < 4000


def test_branch_reuses_the_prefix_and_leaves_the_original(daemon: DaemonProcess, fresh: DaemonProcess) -> None:
    start = [{"role": "user", "content": "Let us talk about trees and the birds that live in them."}]
    a1, _, sid = ask(daemon, start)
    two = [*start, {"role": "assistant", "content": a1}, {"role": "user", "content": "Which birds?"}]
    a2, _, same = ask(daemon, two)
    assert same == sid
    before = (transcript(daemon, sid), fed(daemon.data_dir, sid))

    # The user edits their second message: the request shares the first turn, then diverges.
    edited = [*start, {"role": "assistant", "content": a1}, {"role": "user", "content": "Which trees?"}]
    b2, branch, other = ask(daemon, edited)
    assert other != sid
    assert branch.usage.prompt_tokens_details.cached_tokens > 0  # the shared turn, copied
    assert b2 == fresh_answer(fresh, edited)
    assert transcript(daemon, other)[-2:] == [("user", "Which trees?", "complete"), ("assistant", b2, "complete")]
    # The original conversation is untouched: its transcript and its fed ids...
    assert (transcript(daemon, sid), fed(daemon.data_dir, sid)) == before
    # ...and it goes on from its own cache, exactly.
    three = [*two, {"role": "assistant", "content": a2}, {"role": "user", "content": "Name one more."}]
    a3, c3, again = ask(daemon, three)
    assert again == sid
    assert c3.usage.prompt_tokens_details.cached_tokens > branch.usage.prompt_tokens_details.cached_tokens
    assert a3 == fresh_answer(fresh, three)


def test_three_stateless_turns_across_a_restart(tmp_path: Path, fresh: DaemonProcess) -> None:
    d = DaemonProcess(tmp_path, "--model", MODEL)
    conversation = [{"role": "user", "content": "Remember this: the cache survives restarts."}]
    try:
        for follow_up in ("Say it again.", "Once more, after a restart."):
            answer, _, sid = ask(d, conversation)
            conversation += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
            if follow_up.startswith("Once more"):
                break
    finally:
        assert d.terminate() == 0
    # conversation: user, assistant, user, assistant, user; the third turn goes to a new process.
    d = DaemonProcess(tmp_path, "--model", MODEL)
    try:
        third, completion, same = ask(d, conversation)
        sessions = _session_ids(d)
    finally:
        assert d.terminate() == 0
    assert same == sid and sessions == [sid]  # one conversation, one session
    assert completion.model_extra["kvd"]["restored_from"] == "disk"
    assert completion.usage.prompt_tokens_details.cached_tokens > completion.usage.prompt_tokens // 2
    assert third == fresh_answer(fresh, conversation)


def _session_ids(d: DaemonProcess) -> list[str]:
    with d.client() as c:
        return [s["id"] for s in c.request("session.list")["sessions"]]


def test_an_answer_cut_by_kvd_stop_says_length_kvd_says_cancelled_and_a_whole_one_logs_no_hang_up(
        tmp_path: Path) -> None:
    """A cut answer's finish_reason is OpenAI's "length" (never a value OpenAI's clients do not know);
    the usage chunk's `kvd` object says kvd's own reason, "cancelled"."""
    d = DaemonProcess(tmp_path / "kvd", "--model", MODEL)
    try:
        text, completion, _ = ask(d, [{"role": "user", "content": "hello"}])
        assert completion.choices[0].finish_reason in ("stop", "length")
        assert not any("hung up" in line for line in d.log), d.log  # the client left after a whole answer
        turn = next(line for line in d.log if "turn in session" in line)
        assert "(chat, new session): cache none, 0 tok restored" in turn and "TTFT" in turn, turn
        stream = api(d).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go on"}],
                                                 stream=True, temperature=0, max_tokens=4000,
                                                 stream_options={"include_usage": True})
        reasons: list[str] = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and not reasons:
                reasons.append("under way")
                d.proc.terminate()  # kvd stop: SIGTERM cuts the answer short and keeps it
            if chunk.choices and chunk.choices[0].finish_reason:
                reasons.append(chunk.choices[0].finish_reason)
            if chunk.usage is not None:
                reasons.append((chunk.usage.model_extra or {})["kvd"]["finish_reason"])
        assert reasons == ["under way", "length", "cancelled"]
    finally:
        assert d.terminate() == 0
