"""The new doors' pure rules, without a daemon: who needs the token (guards.token_needed), Ollama's keep_alive
and conversation reading, a forced call's schema and reading, raw prompts and fill-in-the-middle, the metrics'
door labels."""

from __future__ import annotations

import json
from typing import Any

import pytest

from daemon.config import Config
from daemon.doors.forcedcall import ForcedCall, call_schema
from daemon.doors.guards import token_needed
from daemon.doors.httpdoor import ApiError
from daemon.doors.metrics import door_of
from daemon.doors.ollama_api import keep_alive_seconds
from daemon.doors.ollama_schema import OllamaMessage, call_id, conversation
from daemon.doors.rawprompt import RawPrompt, fim_markers

LOOPBACK = Config()
REQUIRED = Config(ollama_token="required")


@pytest.mark.parametrize("method, path, headers, peer, config, needed", [
    ("GET", "/", {}, "192.0.2.9", LOOPBACK, False),
    ("GET", "/health", {}, "192.0.2.9", LOOPBACK, False),
    ("HEAD", "/health", {}, "127.0.0.1", LOOPBACK, False),
    ("POST", "/health", {}, "127.0.0.1", LOOPBACK, True),
    ("GET", "/metrics", {}, "127.0.0.1", LOOPBACK, True),
    ("GET", "/metrics", {}, "127.0.0.1", Config(metrics_public=True), False),
    ("POST", "/api/chat", {}, "127.0.0.1", LOOPBACK, False),
    ("POST", "/api/chat", {}, "::1", LOOPBACK, False),
    ("POST", "/api/chat", {}, "::ffff:127.0.0.1", LOOPBACK, False),
    ("POST", "/api/chat", {}, "192.0.2.9", LOOPBACK, True),  # another machine
    ("POST", "/api/chat", {}, None, LOOPBACK, True),  # no peer known
    ("POST", "/api/chat", {"authorization": "Bearer x"}, "127.0.0.1", LOOPBACK, True),  # a token sent is checked
    ("POST", "/api/chat", {"x-api-key": "x"}, "127.0.0.1", LOOPBACK, True),
    ("POST", "/api/pull", {}, "127.0.0.1", LOOPBACK, True),
    ("DELETE", "/api/delete", {}, "127.0.0.1", LOOPBACK, True),
    ("POST", "/api/chat", {}, "127.0.0.1", REQUIRED, True),
    ("POST", "/v1/chat/completions", {}, "127.0.0.1", LOOPBACK, True),
    ("POST", "/apix", {}, "127.0.0.1", LOOPBACK, True),
])
def test_who_needs_the_token(method: str, path: str, headers: dict[str, str], peer: str | None, config: Config,
                             needed: bool) -> None:
    assert token_needed(method, path, headers, peer, config) is needed


@pytest.mark.parametrize("given, seconds", [(None, None), (300, 300.0), (0, 0.0), (-1, float("inf")),
                                            ("5m", 300.0), ("1h30m", 5400.0), ("1.5s", 1.5), ("-1", float("inf")),
                                            ("0", 0.0), ("250ms", 0.25)])
def test_keep_alive_is_read_as_ollama_writes_it(given: Any, seconds: float | None) -> None:
    assert keep_alive_seconds(given) == seconds


@pytest.mark.parametrize("given", ["soon", "5 m", "m5", "5mm", ""])
def test_a_keep_alive_that_is_no_duration_is_refused(given: str) -> None:
    with pytest.raises(ApiError):
        keep_alive_seconds(given)


def test_calls_sent_back_without_ids_get_the_ids_kvd_gave() -> None:
    """The answer at conversation position m called with ids call_m_k: sent back without them, the same ids."""
    system, said = conversation([
        OllamaMessage(role="system", content="Be brief."), OllamaMessage(role="user", content="Weather?"),
        OllamaMessage.model_validate({"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "get_time", "arguments": {}}}]}),
        OllamaMessage(role="tool", content="12:00", tool_name="get_time"),
        OllamaMessage(role="tool", content="Sunny"),
        OllamaMessage(role="user", content="Thanks")])
    assert system == "Be brief."
    assert [m.role for m in said] == ["user", "assistant", "tool", "tool", "user"]
    calls = said[1].tool_calls
    assert [c["id"] for c in calls] == [call_id(1, 0), call_id(1, 1)]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert said[2].tool_call_id == call_id(1, 1)  # by its tool_name
    assert said[3].tool_call_id == call_id(1, 0)  # the one left, in order


def test_a_forced_calls_schema_closes_the_arguments_and_names_the_function() -> None:
    tools: list[dict[str, Any]] = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}}}},
             {"type": "function", "function": {"name": "g"}}]
    both = call_schema(tools)
    assert [o["properties"]["name"]["const"] for o in both["anyOf"]] == ["f", "g"]
    f = call_schema(tools, "f")
    assert f["properties"]["arguments"]["additionalProperties"] is False
    assert f["properties"]["arguments"]["properties"]["a"]["additionalProperties"] is False
    assert tools[0]["function"]["parameters"].get("additionalProperties") is None  # the request's own is untouched


def test_a_forced_call_is_read_once_when_the_answer_ends() -> None:
    split = ForcedCall(ids=lambda k: f"call_{k}")
    assert split.feed('{"name": "f", ') == "" and split.feed('"arguments": {"a": 1}}') == ""
    assert split.finish() == ("", [{"id": "call_0", "name": "f", "arguments": '{"a": 1}'}]) and split.content == ""
    cut = ForcedCall()
    cut.feed('{"name": "f", "argu')
    assert cut.finish() == ('{"name": "f", "argu', []) and cut.content == '{"name": "f", "argu'


class FakeTokenizer:
    """Text as its characters' codes, "<fim_*>" and "<s>" as single tokens (ids above 1000)."""

    special = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<s>"]
    bos_token = "<s>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out = [1003] if add_special_tokens else []
        i = 0
        while i < len(text):
            found = next((s for s in self.special if text.startswith(s, i)), None)
            out.append(1000 + self.special.index(found) if found else ord(text[i]))
            i += len(found) if found else 1
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.special[i - 1000] if i >= 1000 else chr(i) for i in ids)


def test_fill_in_the_middle_is_prefix_suffix_middle_with_the_models_markers() -> None:
    tok = FakeTokenizer()
    markers = fim_markers(tok)
    assert markers == ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
    ids, _ = RawPrompt("ab", suffix="c", markers=markers).ids(tok)
    assert ids == [1003, 1000, ord("a"), ord("b"), 1001, ord("c"), 1002]
    assert RawPrompt("<s>x").ids(tok)[0] == [1003, ord("x")]  # a BOS the text has is not added again
    assert RawPrompt(ids_given=(5, 6)).ids(tok)[0] == [5, 6]
    tok.special = ["<s>"]
    assert fim_markers(tok) is None


@pytest.mark.parametrize("path, websocket, door", [
    ("/api/chat", False, "ollama"), ("/v1/chat/completions", False, "chat"), ("/v1/completions", False,
                                                                                "completions"),
    ("/v1/responses/resp_1", False, "responses"), ("/v1/messages/count_tokens", False, "messages"),
    ("/health", False, "health"), ("/metrics", False, "metrics"), ("/", False, "root"), ("/v1", True, "websocket"),
    ("/v1/chat/completionsX", False, "other"), ("/etc/passwd", False, "other")])
def test_a_requests_door_label_is_one_of_a_few(path: str, websocket: bool, door: str) -> None:
    assert door_of(path, websocket) == door
