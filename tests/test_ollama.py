"""The official `ollama` package against a real `kvd serve`: chat (multi-turn, tools, format with a schema),
generate (also raw), list, show, ps, pull, delete and /api/version, streaming and not; a chat's second turn
restored from its cache, also after `kvd stop` and a start; who may connect without the token; LangChain's
`ChatOllama` (langchain-ollama, over the same package) through a multi-turn exchange.

The package drops fields it does not know, so kvd's own figures (`kvd` in a final object) are read from the
very responses the package got, by an httpx event hook (the package passes its keyword arguments to httpx).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_ollama import ChatOllama

from daemonproc import DaemonProcess
from toolmodel import WEATHER_TOOL, write_tool_model

MODEL = "builtin:tiny"
GREEDY: dict[str, Any] = {"temperature": 0, "num_predict": 8}
LONG = " ".join(f"Rule {i}: answer in plain words and keep every promise made earlier." for i in range(60))
ORDER: dict[str, Any] = {  # a finite language: every answer ends once the object is whole
    "type": "object",
    "properties": {"size": {"enum": ["small", "medium", "large"]}, "hot": {"type": "boolean"}},
    "required": ["size", "hot"], "additionalProperties": False,
}


class Finals:
    """The last NDJSON line (or the JSON body) of every /api/chat and /api/generate response, as sent."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def hook(self, response: httpx.Response) -> None:
        if response.request.url.path in ("/api/chat", "/api/generate") and response.status_code == 200:
            response.read()
            lines = [json.loads(line) for line in response.text.splitlines() if line.strip()]
            self.seen.append(lines[-1])

    @property
    def last(self) -> dict[str, Any]:
        return self.seen[-1]


def client(d: DaemonProcess, finals: Finals | None = None, **kw: Any) -> ollama.Client:
    """The package as an Ollama user points it at kvd: the daemon's address, no token (loopback)."""
    hooks = {"response": [finals.hook]} if finals is not None else {}
    return ollama.Client(host=root(d), event_hooks=hooks, **kw)


def root(d: DaemonProcess) -> str:
    """The daemon's address without the websocket's path: where Ollama's clients find its API."""
    return d.base_url.removesuffix("/v1")


def with_token(d: DaemonProcess, **kw: Any) -> ollama.Client:
    return ollama.Client(host=root(d), headers={"Authorization": f"Bearer {d.token}"}, **kw)


def settled(d: DaemonProcess) -> None:
    """Wait until the caches the turns left are written (a status is answered after the writes before it)."""
    with d.client() as c:
        assert c.request("status")["type"] == "status"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("kvd") / "data")
    with d.client():
        pass  # the model has loaded
    yield d
    assert d.terminate() == 0
    assert "Traceback" not in "".join(d.log)


def test_chat_multi_turn_streamed_and_not_reads_only_the_new_message(daemon: DaemonProcess) -> None:
    finals = Finals()
    api = client(daemon, finals)
    ask: list[Any] = [{"role": "system", "content": LONG}, {"role": "user", "content": "Tell me about rivers."}]
    first = api.chat(model=MODEL, messages=ask, options=GREEDY)
    assert first.done and first.done_reason in ("stop", "length") and first.message.role == "assistant"
    assert first.eval_count and first.eval_count >= 1 and first.total_duration and first.total_duration > 0
    one = finals.last["kvd"]
    assert first.prompt_eval_count == one["prompt_tokens"] - one["cached_tokens"]
    convo: list[Any] = [*ask, {"role": "assistant", "content": first.message.content},
                        {"role": "user", "content": "And lakes?"}]
    parts = list(api.chat(model=MODEL, messages=convo, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    two = finals.last["kvd"]
    assert two["session"] == one["session"]  # placed on the session that holds the conversation
    print(f"2nd turn: {two['cached_tokens']} of {two['prompt_tokens']} prompt tokens restored ({two['restored_from']})")
    assert two["cached_tokens"] >= 0.9 * two["prompt_tokens"], two
    assert parts[-1].prompt_eval_count == two["prompt_tokens"] - two["cached_tokens"]
    # Greedy: the same second turn again, not streamed, is the same answer (a new session, as a retry is).
    again = api.chat(model=MODEL, messages=convo, options=GREEDY)
    assert again.message.content == "".join(p.message.content or "" for p in parts)


def test_generate_streamed_not_and_raw(daemon: DaemonProcess) -> None:
    api = client(daemon)
    whole = api.generate(model=MODEL, prompt="Once upon a time", options=GREEDY)
    streamed = list(api.generate(model=MODEL, prompt="Once upon a time", options=GREEDY, stream=True))
    assert whole.done and whole.eval_count == GREEDY["num_predict"] or whole.done_reason == "stop"
    assert "".join(p.response or "" for p in streamed) == whole.response
    raw = api.generate(model=MODEL, prompt="<|im_start|>user\nOnce upon a time<|im_end|>\n<|im_start|>assistant\n",
                       raw=True, options=GREEDY)
    # The template's own text, fed raw: the same greedy answer (a raw prompt's answer keeps its first space).
    assert raw.response is not None and raw.response.removeprefix(" ") == whole.response
    loaded = api.generate(model=MODEL)  # no prompt: Ollama's "load the model"
    assert loaded.done and loaded.done_reason == "load"


def test_format_with_a_schema_holds_the_answer(daemon: DaemonProcess) -> None:
    api = client(daemon)
    ask = [{"role": "user", "content": "A coffee, as JSON."}]
    answer = api.chat(model=MODEL, messages=ask, format=ORDER, options={"temperature": 0, "num_predict": 400})
    assert answer.done_reason == "stop"
    jsonschema.validate(json.loads(answer.message.content or ""), ORDER)
    streamed = api.chat(model=MODEL, messages=ask, format=ORDER, options={"temperature": 0, "num_predict": 400},
                        stream=True)
    assert json.loads("".join(p.message.content or "" for p in streamed)) == json.loads(answer.message.content or "")
    made = api.generate(model=MODEL, prompt="JSON, please.", format="json", options={"temperature": 0,
                                                                                         "num_predict": 400})
    assert isinstance(json.loads(made.response or ""), dict)
    with pytest.raises(ollama.ResponseError) as refused:
        api.chat(model=MODEL, messages=ask, format={"type": "object", "required": ["a"], "properties": {
            "a": {"$ref": "#"}}})
    assert refused.value.status_code == 400


def test_models_list_show_ps_version(daemon: DaemonProcess) -> None:
    api = client(daemon)
    names = [m.model for m in api.list().models]
    assert MODEL in names and "builtin:smollm2" in names
    shown = api.show(MODEL)
    assert shown.details is not None and shown.details.family == "qwen2"
    assert shown.modelinfo is not None and shown.modelinfo["qwen2.context_length"] > 0
    assert shown.template and "im_start" in shown.template and shown.capabilities
    running = api.ps().models
    assert [m.model for m in running] == [MODEL] and running[0].context_length
    with pytest.raises(ollama.ResponseError) as unknown:
        api.show("no-such-model")
    assert unknown.value.status_code == 404
    version = httpx.get(f"{root(daemon)}/api/version").json()  # the package has no call for it
    assert version["version"] and version["kvd"]


def test_pull_and_delete_need_the_token(daemon: DaemonProcess) -> None:
    with pytest.raises(ollama.ResponseError) as refused:
        client(daemon).pull("builtin:tiny-swa")
    assert refused.value.status_code == 401
    api = with_token(daemon)
    steps = list(api.pull("builtin:tiny-swa", stream=True))
    assert steps[-1].status == "success"
    assert api.pull("builtin:tiny-swa").status == "success"  # already here: at once
    assert api.delete("builtin:tiny-swa").status == "success"
    with pytest.raises(ollama.ResponseError) as gone:
        api.delete("builtin:tiny-swa")
    assert gone.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as kept:
        api.delete(MODEL)  # the model kvd serves
    assert kept.value.status_code == 409
    with pytest.raises(ollama.ResponseError) as nowhere:
        api.pull("./no/such/model.gguf")
    assert nowhere.value.status_code == 404 and "no/such/model.gguf" in str(nowhere.value)


def test_what_kvd_does_not_serve_is_a_clear_error(daemon: DaemonProcess) -> None:
    api = client(daemon)
    with pytest.raises(ollama.ResponseError) as embed:
        api.embed(model=MODEL, input="hello")
    assert embed.value.status_code == 501 and "embeddings" in str(embed.value)
    with pytest.raises(ollama.ResponseError) as images:
        api.chat(model=MODEL, messages=[{"role": "user", "content": "What is this?", "images": ["aGVsbG8="]}])
    assert images.value.status_code == 400 and "images" in str(images.value)
    with pytest.raises(ollama.ResponseError) as think:
        api.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}], think=True)
    assert think.value.status_code == 400


def test_langchain_chat_ollama_multi_turn(daemon: DaemonProcess) -> None:
    """LangChain's ChatOllama as its users write it: the address, the model, options as fields; no token."""
    finals = Finals()
    chat = ChatOllama(model=MODEL, base_url=root(daemon), temperature=0, num_predict=8,
                      sync_client_kwargs={"event_hooks": {"response": [finals.hook]}})
    convo: list[BaseMessage] = [SystemMessage(LONG + " (langchain)"), HumanMessage("Tell me about rivers.")]
    first = chat.invoke(convo)
    assert isinstance(first, AIMessage) and first.content
    assert first.usage_metadata is not None and first.usage_metadata["output_tokens"] >= 1
    one = finals.last["kvd"]
    convo += [first, HumanMessage("And lakes?")]
    second = "".join(str(chunk.content) for chunk in chat.stream(convo))
    two = finals.last["kvd"]
    assert second and two["session"] == one["session"]  # the same conversation, found again
    print(f"ChatOllama's 2nd turn: {two['cached_tokens']} of {two['prompt_tokens']} prompt tokens restored")
    assert two["cached_tokens"] >= 0.9 * two["prompt_tokens"], two
    convo += [AIMessage(second), HumanMessage("And seas?")]
    third = chat.invoke(convo)
    assert third.content and finals.last["kvd"]["session"] == one["session"]


# --- tools: the script model calls get_weather; the call goes back without an id, as Ollama's clients send it


@pytest.fixture(scope="module")
def tool_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    model = write_tool_model(tmp_path_factory.mktemp("tool-model"))
    d = DaemonProcess(tmp_path_factory.mktemp("kvd-tools") / "data", "--model", str(model))
    yield d
    assert d.terminate() == 0
    assert "Traceback" not in "".join(d.log)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip_stays_one_session(tool_daemon: DaemonProcess, stream: bool) -> None:
    finals = Finals()
    api = client(tool_daemon, finals)
    ask: list[Any] = [{"role": "user", "content": f"Weather in Paris? ({stream})"}]
    if stream:
        parts = list(api.chat(model="tool-caller", messages=ask, tools=[WEATHER_TOOL], stream=True))
        calls = [c for p in parts for c in p.message.tool_calls or ()]
        content = "".join(p.message.content or "" for p in parts)
    else:
        first = api.chat(model="tool-caller", messages=ask, tools=[WEATHER_TOOL])
        calls, content = list(first.message.tool_calls or ()), first.message.content or ""
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    session = finals.last["kvd"]["session"]
    # What an Ollama client sends back: the assistant's message as the package gave it, the tool's answer.
    convo = [*ask, {"role": "assistant", "content": content, "tool_calls": [c.model_dump() for c in calls]},
             {"role": "tool", "content": "Sunny, 21 C", "tool_name": "get_weather"}]
    second = api.chat(model="tool-caller", messages=convo, tools=[WEATHER_TOOL])
    assert second.message.tool_calls  # the script calls again; a model would answer
    assert finals.last["kvd"]["session"] == session  # the call, sent back without an id, found its session
    with httpx.Client(base_url=root(tool_daemon), headers={"Authorization": f"Bearer {tool_daemon.token}"}) as http:
        kept = http.get(f"/v1/kvd/sessions/{session}").json()["messages"]
    assert [m["role"] for m in kept] == ["user", "assistant", "tool", "assistant"]


# --- across a restart


def test_a_chat_continues_from_its_cache_after_a_restart(tmp_path: Path) -> None:
    finals = Finals()
    ask: list[Any] = [{"role": "system", "content": LONG}, {"role": "user", "content": "Tell me about rivers."}]
    d = DaemonProcess(tmp_path / "data")
    try:
        first = client(d, finals).chat(model=MODEL, messages=ask, options=GREEDY)
        session = finals.last["kvd"]["session"]
        settled(d)
    finally:
        assert d.terminate() == 0
    d = DaemonProcess(tmp_path / "data")
    try:
        convo: list[Any] = [*ask, {"role": "assistant", "content": first.message.content},
                            {"role": "user", "content": "And lakes?"}]
        list(client(d, finals).chat(model=MODEL, messages=convo, options=GREEDY, stream=True))
    finally:
        assert d.terminate() == 0
    after = finals.last["kvd"]
    assert after["session"] == session and after["restored_from"] == "disk"
    print(f"after a restart: {after['cached_tokens']} of {after['prompt_tokens']} prompt tokens restored")
    assert after["cached_tokens"] >= 0.9 * after["prompt_tokens"], after
    assert "Traceback" not in "".join(d.log)
