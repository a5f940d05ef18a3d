"""The Anthropic Messages door under the chat door's hostile input (test_hostile_http.py,
test_hostile_schemas.py), against the same real `kvd serve`: every refusal is a 4xx in Anthropic's shape
that stores nothing; costly bodies and schemas do not stall another client's pings; a burst past the
queue gets 429 with Retry-After, and a body shorter than its Content-Length a 408 (both in
test_hostile_http.py, parametrized by door)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from common.limits import MAX_MESSAGES
from daemonproc import DaemonProcess
from test_hostile_http import LONG_STOPS, beside_pings, daemon, stored
from test_hostile_schemas import SCHEMAS

__all__ = ["daemon"]  # the module's daemon, shared with test_hostile_http's fixture

HI: dict[str, Any] = {"model": "builtin:tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def post(d: DaemonProcess, body: bytes | dict[str, Any], path: str = "/v1/messages", **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    root = d.base_url.removesuffix("/v1")
    return httpx.post(f"{root}{path}", content=content, timeout=60,
                      headers={"x-api-key": d.token, "anthropic-version": "2023-06-01",
                               "content-type": "application/json", **headers})


def msgs(n: int) -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(n)]


def result(i: int, call: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call, "content": "x"}]}


TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {}}}

REFUSALS: list[tuple[str, bytes | dict[str, Any], dict[str, str], int, str]] = [
    ("not json", b"{nope", {}, 400, "invalid_request_error"),
    ("nested 100,000 deep", b"[" * 100_000 + b"]" * 100_000, {}, 400, "invalid_request_error"),
    ("not an object", b"[1, 2]", {}, 400, "invalid_request_error"),
    ("no max_tokens", {"messages": HI["messages"]}, {}, 400, "invalid_request_error"),
    ("max_tokens 0", {**HI, "max_tokens": 0}, {}, 400, "invalid_request_error"),
    ("a lone surrogate", b'{"max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}', {}, 400,
     "invalid_request_error"),
    ("a surrogate in a stop", b'{"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], '
                              b'"stop_sequences": ["\\udfff"]}', {}, 400, "invalid_request_error"),
    ("a surrogate in a system block", b'{"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], '
                                      b'"system": [{"type": "text", "text": "\\ud800"}]}', {}, 400,
     "invalid_request_error"),
    ("wrong type", {**HI, "max_tokens": "5"}, {}, 400, "invalid_request_error"),
    ("temperature NaN", b'{"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
     {}, 400, "invalid_request_error"),
    ("an unknown role", {**HI, "messages": [{"role": "robot", "content": "x"}]}, {}, 400, "invalid_request_error"),
    ("no messages", {**HI, "messages": []}, {}, 400, "invalid_request_error"),
    ("an image", {**HI, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]}, {}, 400,
     "invalid_request_error"),
    ("a document", {**HI, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}, {}, 400,
     "invalid_request_error"),
    ("a stray tool result", {**HI, "messages": [result(0, "toolu_x")]}, {}, 400, "invalid_request_error"),
    ("an assistant message last", {**HI, "messages": msgs(2)}, {}, 400, "invalid_request_error"),
    ("129 tools", {**HI, "tools": [TOOL] * 129}, {}, 400, "invalid_request_error"),
    ("a tool without its schema", {**HI, "tools": [{"name": "f"}]}, {}, 400, "invalid_request_error"),
    ("tool_choice any without tools", {**HI, "tool_choice": {"type": "any"}}, {}, 400, "invalid_request_error"),
    ("five stops", {**HI, "stop_sequences": ["a", "b", "c", "d", "e"]}, {}, 400, "invalid_request_error"),
    ("a 500,000-character stop", {**HI, "stop_sequences": ["x" * 500_000]}, {}, 400, "invalid_request_error"),
    ("too many messages", {**HI, "messages": msgs(MAX_MESSAGES + 1)}, {}, 400, "invalid_request_error"),
    ("longer than the context", {**HI, "messages": [{"role": "user", "content": "x " * 15_500}]}, {}, 400,
     "invalid_request_error"),
    ("longer than max_text_chars", {**HI, "messages": [{"role": "user", "content": "word " * 180_000}]}, {}, 400,
     "invalid_request_error"),
    ("a bad session id", HI, {"X-Kvd-Session": "../etc"}, 400, "invalid_request_error"),
    ("a model kvd does not serve", {**HI, "model": "claude-sonnet-4-5"}, {}, 404, "not_found_error"),
    ("an unknown session", HI, {"X-Kvd-Session": "0123456789abcdef"}, 404, "not_found_error"),
    ("too large a body", {**HI, "messages": [{"role": "user", "content": "x" * 1_100_000}]}, {}, 413,
     "request_too_large"),
    ("no token", HI, {"x-api-key": ""}, 401, "authentication_error"),
    ("a foreign host", HI, {"Host": "evil.example"}, 403, "permission_error"),
    ("a foreign origin", HI, {"Origin": "https://evil.example"}, 403, "permission_error"),
]


# count_tokens needs no max_tokens, counts past the context, and places nothing (no session header).
NOT_COUNTED = {"no max_tokens", "longer than the context", "a bad session id", "an unknown session"}
CASES = [(path, *refusal) for path in ("/v1/messages", "/v1/messages/count_tokens") for refusal in REFUSALS
         if path == "/v1/messages" or refusal[0] not in NOT_COUNTED]


@pytest.mark.parametrize("path, case, body, headers, status, kind", CASES, ids=[f"{c[1]}-{c[0]}" for c in CASES])
def test_a_refused_request_is_a_4xx_in_anthropic_shape_and_stores_nothing(
        daemon: DaemonProcess, path: str, case: str, body: bytes | dict[str, Any], headers: dict[str, str],
        status: int, kind: str) -> None:
    before = stored(daemon)
    r = post(daemon, body, path, **headers)
    assert r.status_code == status, (case, r.status_code, r.text[:300])
    shaped = r.json()
    assert shaped["type"] == "error" and set(shaped["error"]) == {"type", "message"}, shaped
    assert shaped["error"]["type"] == kind and shaped["error"]["message"], shaped
    assert stored(daemon) == before, case
    assert post(daemon, HI).status_code == 200  # still serving


def test_an_unknown_path_or_method_is_refused_in_anthropic_shape(daemon: DaemonProcess) -> None:
    root = daemon.base_url.removesuffix("/v1")
    for method, path, status in (("POST", "/v1/messages/batches", 404), ("GET", "/v1/messages", 405)):
        r = httpx.request(method, f"{root}{path}", headers={"x-api-key": daemon.token}, json=HI, timeout=60)
        assert r.status_code == status and r.json()["type"] == "error", r.text


EVENT_LOOP_CASES: list[tuple[str, bytes | dict[str, Any]]] = [
    ("a 500,000-character stop", {**HI, "stop_sequences": ["x" * 500_000]}),
    ("20,000 messages", {**HI, "messages": msgs(20_000)}),
    ("nested 1,000,000 deep", b"[" * 1_000_000),
    ("a 900 KB message in text blocks", {**HI, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "word " * 1_000}] * 180}]}),
    ("30 KB past the context", {**HI, "messages": [{"role": "user", "content": "x " * 15_500}]}),
    ("the longest stops over a streamed answer", {**HI, "stop_sequences": LONG_STOPS, "max_tokens": 200,
                                                  "stream": True}),
]


@pytest.mark.parametrize("case, body", EVENT_LOOP_CASES, ids=[c[0] for c in EVENT_LOOP_CASES])
def test_a_costly_request_does_not_stall_another_clients_pings(
        daemon: DaemonProcess, case: str, body: bytes | dict[str, Any]) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()

    def request() -> None:
        r = post(daemon, content)
        assert r.status_code in (200, 400), (case, r.status_code, r.text[:200])

    beside_pings(daemon, case, request)


@pytest.mark.parametrize("case, schema, says", SCHEMAS, ids=[s[0] for s in SCHEMAS])
def test_an_output_schema_kvd_cannot_hold_is_a_400_that_stores_nothing_and_stalls_no_one(
        daemon: DaemonProcess, case: str, schema: Any, says: str) -> None:
    content = json.dumps({**HI, "output_config": {"format": {"type": "json_schema", "schema": schema}}}).encode()
    before = stored(daemon)

    def request() -> None:
        r = post(daemon, content)
        assert r.status_code == 400 and says in r.json()["error"]["message"], (case, r.status_code, r.text[:300])

    beside_pings(daemon, case, request, at_least=3, seconds=3.0)
    assert stored(daemon) == before
