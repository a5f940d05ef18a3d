"""Ollama's door (/api/...) under hostile input, against a real `kvd serve` (docs/ollama.md):

- who may connect: an Ollama client on this machine without the token, but never a web page (a foreign
  Host: DNS rebinding; a browser's Origin), never with a wrong token, never for pull or delete, and never
  from another machine; [api] ollama_token = "required" asks the token of everyone;
- every refusal is a 4xx in Ollama's shape (`{"error": "..."}`) that stores nothing: malformed, huge and
  deeply nested bodies, values out of range, what kvd does not serve;
- no traceback in the log.
"""

from __future__ import annotations

import json
import socket
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.limits import MAX_MESSAGES
from conftest import running_daemon
from daemonproc import DaemonProcess

HI: dict[str, Any] = {"model": "builtin:tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False,
                      "options": {"num_predict": 2}}
GEN: dict[str, Any] = {"model": "builtin:tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
DEEP = b'{"y": ' * 300 + b"1" + b"}" * 300  # past common/jsondepth's 256 levels


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("kvd") / "data")
    with d.client():
        pass  # the model has loaded
    yield d
    assert d.terminate() == 0
    log = "".join(d.log)
    assert "Traceback" not in log, log


def root(d: DaemonProcess) -> str:
    return d.base_url.removesuffix("/v1")


def stored(d: DaemonProcess) -> tuple[int, int]:
    db = sqlite3.connect(f"file:{d.data_dir / 'kvd.sqlite'}?mode=ro", uri=True)
    try:
        return (db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0],
                db.execute("SELECT COUNT(*) FROM messages").fetchone()[0])
    finally:
        db.close()


def call(d: DaemonProcess, path: str, body: bytes | dict[str, Any] | None = None, *, method: str = "POST",
         **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    return httpx.request(method, f"{root(d)}{path}", content=content, timeout=60,
                         headers={"Content-Type": "application/json", **headers})


# --- who may connect


def test_an_ollama_client_here_needs_no_token(daemon: DaemonProcess) -> None:
    for path, method, body in [("/api/tags", "GET", None), ("/api/ps", "GET", None), ("/api/version", "GET", None),
                               ("/api/show", "POST", {"model": "builtin:tiny"}), ("/api/chat", "POST", HI),
                               ("/api/generate", "POST", GEN)]:
        r = call(daemon, path, body, method=method)
        assert r.status_code == 200, (path, r.text[:200])


GUARDS: list[tuple[str, str, str, dict[str, Any] | None, dict[str, str], int]] = [
    # (case, method, path, body, headers, status)
    ("a wrong token", "POST", "/api/chat", HI, {"Authorization": "Bearer wrong"}, 401),
    ("a wrong x-api-key", "GET", "/api/tags", None, {"x-api-key": "wrong"}, 401),
    ("a foreign Host (DNS rebinding)", "POST", "/api/chat", HI, {"Host": "attacker.example"}, 403),
    ("a rebinding Host with the port", "GET", "/api/tags", None, {"Host": "attacker.example:11434"}, 403),
    ("a page's Origin", "POST", "/api/chat", HI, {"Origin": "https://evil.example"}, 403),
    ("a sandboxed page's null Origin", "POST", "/api/generate", GEN, {"Origin": "null"}, 403),
    ("a page's Origin on the loopback name", "POST", "/api/chat", HI, {"Origin": "http://localhost:3000"}, 403),
    ("a page's DELETE", "DELETE", "/api/delete", {"model": "builtin:tiny-swa"}, {"Origin": "https://evil.example"},
     403),
    ("pull without the token", "POST", "/api/pull", {"model": "builtin:tiny-swa"}, {}, 401),
    ("delete without the token", "DELETE", "/api/delete", {"model": "builtin:tiny-swa"}, {}, 401),
    ("metrics without the token", "GET", "/metrics", None, {}, 401),
    ("the OpenAI door without the token", "POST", "/v1/chat/completions", HI, {}, 401),
]


@pytest.mark.parametrize("case, method, path, body, headers, status", GUARDS, ids=[g[0] for g in GUARDS])
def test_who_is_refused(daemon: DaemonProcess, case: str, method: str, path: str, body: dict[str, Any] | None,
                        headers: dict[str, str], status: int) -> None:
    before = stored(daemon)
    r = call(daemon, path, body, method=method, **headers)
    assert r.status_code == status, r.text[:200]
    if path.startswith("/api/"):
        assert set(r.json()) == {"error"} and r.json()["error"], r.text
    assert stored(daemon) == before


def test_a_remote_peer_needs_the_token(tmp_path: Path) -> None:
    """kvd listening beyond loopback: a client from another address is no Ollama client "here"."""
    address = next((a for a in socket.gethostbyname_ex(socket.gethostname())[2] if not a.startswith("127.")), None)
    if address is None:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.connect(("192.0.2.1", 9))  # no packet is sent: the routing table names this machine's address
        address = probe.getsockname()[0]
        probe.close()
    assert not address.startswith("127."), "this machine has no address but loopback"
    config = tmp_path / "kvd.toml"
    config.write_text(f'[cache]\nprefetch = false\n[server]\nhost = "0.0.0.0"\nallowed_hosts = ["{address}"]\n')
    d = DaemonProcess(tmp_path / "data", "--config", str(config))
    try:
        port = d.base_url.rsplit(":", 1)[1].split("/")[0]
        far = httpx.get(f"http://{address}:{port}/api/tags", timeout=60)
        with_token = httpx.get(f"http://{address}:{port}/api/tags", timeout=60,
                               headers={"Authorization": f"Bearer {d.token}"})
        near = httpx.get(f"http://127.0.0.1:{port}/api/tags", timeout=60)
    finally:
        assert d.terminate() == 0
    assert (far.status_code, with_token.status_code, near.status_code) == (401, 200, 200), far.text


def test_ollama_token_required_asks_everyone(tmp_path: Path) -> None:
    config = tmp_path / "kvd.toml"
    config.write_text('[cache]\nprefetch = false\n[api]\nollama_token = "required"\n')
    d = DaemonProcess(tmp_path / "data", "--config", str(config))
    try:
        with d.client():
            pass  # the model has loaded
        without = call(d, "/api/tags", method="GET")
        chat = call(d, "/api/chat", HI)
        token = call(d, "/api/tags", method="GET", Authorization=f"Bearer {d.token}")
        health = call(d, "/health", method="GET")
    finally:
        assert d.terminate() == 0
    assert (without.status_code, chat.status_code, token.status_code) == (401, 401, 200)
    assert without.json()["error"]
    assert health.status_code == 200


# --- what is refused, and stores nothing

REFUSALS: list[tuple[str, str, bytes | dict[str, Any], int]] = [
    # (case, path, body, status)
    ("not json", "/api/chat", b"{nope", 400),
    ("nested 100,000 deep", "/api/chat", b"[" * 100_000 + b"]" * 100_000, 400),
    ("a field nested 300 deep", "/api/chat", json.dumps(HI).encode()[:-1] + b', "extra": ' + DEEP + b"}", 400),
    ("options nested 300 deep", "/api/generate", json.dumps(GEN).encode()[:-1] + b', "options": ' + DEEP + b"}",
     400),
    ("a format nested 300 deep", "/api/chat", json.dumps(HI).encode()[:-1] + b', "format": ' + DEEP + b"}", 400),
    ("not an object", "/api/chat", b"[1, 2]", 400),
    ("a lone surrogate", "/api/chat", b'{"model": "builtin:tiny", "messages": [{"role": "user", "content": '
     b'"a\\ud800b"}]}', 400),
    ("no model", "/api/chat", {"messages": HI["messages"]}, 400),
    ("wrong type", "/api/chat", {**HI, "stream": "no"}, 400),
    ("a temperature of 5", "/api/chat", {**HI, "options": {"temperature": 5}}, 400),
    ("temperature as text", "/api/chat", {**HI, "options": {"temperature": "0.5"}}, 400),
    ("num_predict 0", "/api/chat", {**HI, "options": {"num_predict": 0}}, 400),
    ("num_ctx 0", "/api/chat", {**HI, "options": {"num_ctx": 0}}, 400),
    ("options not an object", "/api/chat", {**HI, "options": [1]}, 400),
    ("a 100,000-character stop", "/api/chat", {**HI, "options": {"stop": ["x" * 100_000]}}, 400),
    ("unknown role", "/api/chat", {**HI, "messages": [{"role": "robot", "content": "x"}]}, 400),
    ("a later system message", "/api/chat", {**HI, "messages": [*HI["messages"], {"role": "system",
                                                                                   "content": "x"}]}, 400),
    ("a tool result answering no call", "/api/chat", {**HI, "messages": [*HI["messages"], {"role": "tool",
                                                                                          "content": "x"}]}, 400),
    ("images", "/api/chat", {**HI, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400),
    ("think", "/api/chat", {**HI, "think": True}, 400),
    ("top_logprobs without logprobs", "/api/chat", {**HI, "top_logprobs": 2}, 400),
    ("top_logprobs past 20", "/api/chat", {**HI, "logprobs": True, "top_logprobs": 21}, 400),
    ("a bad keep_alive", "/api/chat", {**HI, "keep_alive": "soon"}, 400),
    ("a schema without an end", "/api/chat", {**HI, "format": {"type": "object", "required": ["a"],
                                                               "properties": {"a": {"$ref": "#"}}}}, 400),
    ("a format of another word", "/api/chat", {**HI, "format": "yaml"}, 400),
    ("too many messages", "/api/chat", {**HI, "messages": [{"role": "user", "content": "m"}] * (MAX_MESSAGES + 1)},
     400),
    ("longer than max_text_chars", "/api/chat", {**HI, "messages": [{"role": "user", "content": "w " * 20_000}]},
     400),
    ("longer than the context", "/api/chat", {**HI, "messages": [{"role": "user", "content": "x " * 15_500}]}, 400),
    ("too large a body", "/api/chat", {**HI, "messages": [{"role": "user", "content": "x" * 1_100_000}]}, 413),
    ("a model kvd does not serve", "/api/chat", {**HI, "model": "llama3.2"}, 404),
    ("context", "/api/generate", {**GEN, "context": [1, 2, 3]}, 400),
    ("a template", "/api/generate", {**GEN, "template": "{{ .Prompt }}"}, 400),
    ("raw with a system prompt", "/api/generate", {**GEN, "raw": True, "system": "x"}, 400),
    ("a suffix for a model without fill-in-the-middle", "/api/generate", {**GEN, "suffix": "return x"}, 400),
    ("generate's images", "/api/generate", {**GEN, "images": ["aGk="]}, 400),
    ("show without a model", "/api/show", {}, 400),
    ("show of a model kvd does not serve", "/api/show", {"model": "llama3.2"}, 404),
    ("show nested 300 deep", "/api/show", b'{"model": "builtin:tiny", "x": ' + DEEP + b"}", 400),
    ("embed", "/api/embed", {"model": "builtin:tiny", "input": "hi"}, 501),
    ("embeddings", "/api/embeddings", {"model": "builtin:tiny", "prompt": "hi"}, 501),
    ("create", "/api/create", {"model": "mine", "from": "builtin:tiny"}, 501),
    ("an unknown endpoint", "/api/nope", {}, 404),
]


@pytest.mark.parametrize("case, path, body, status", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_refused_request_is_a_4xx_in_ollama_shape_and_stores_nothing(
        daemon: DaemonProcess, case: str, path: str, body: bytes | dict[str, Any], status: int) -> None:
    before = stored(daemon)
    r = call(daemon, path, body)
    assert r.status_code == status, r.text[:300]
    assert set(r.json()) == {"error"} and r.json()["error"], r.text[:300]
    assert stored(daemon) == before
    assert call(daemon, "/api/chat", HI).status_code == 200  # and kvd keeps serving


@pytest.mark.parametrize("path", ["/api/pull", "/api/delete"])
def test_pull_and_delete_refuse_bad_bodies_too(daemon: DaemonProcess, path: str) -> None:
    auth = {"Authorization": f"Bearer {daemon.token}"}
    method = "DELETE" if path == "/api/delete" else "POST"
    for body, status in [(b"{nope", 400), (b"[" * 100_000 + b"]" * 100_000, 400), (b"[1]", 400), (b"{}", 400),
                         (b'{"model": 5}', 400), (b'{"model": "x", "y": ' + DEEP + b"}", 400),
                         (json.dumps({"model": "x" * 2_000_000}).encode(), 413)]:
        r = call(daemon, path, body, method=method, **auth)
        assert r.status_code == status and r.json()["error"], (body[:40], r.text[:200])
    outside = call(daemon, "/api/delete", {"model": "/etc/passwd"}, method="DELETE", **auth)
    assert outside.status_code in (403, 404) and Path("/etc/passwd").exists()


@pytest.mark.anyio
async def test_a_refusal_after_the_turn_started_gives_the_log_its_reason(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A conversation past the model's context is refused by the engine, after the turn started: the log's
    refusal line still says why, as for a refusal of the body."""
    import logging

    caplog.set_level(logging.INFO)
    async with running_daemon(tmp_path / "data") as d:
        async with httpx.AsyncClient(base_url=d.url.replace("ws://", "http://").removesuffix("/v1"),
                                     timeout=60) as http:
            for stream in (False, True):
                r = await http.post("/api/chat", json={**HI, "stream": stream, "messages": [
                    {"role": "user", "content": "x " * 15_500}]})
                assert r.status_code == 400 and set(r.json()) == {"error"}, r.text[:300]
        assert d.store.list_sessions() == []
    # (The second, of the same kind within a second, is counted into the next line rather than logged.)
    said = [r.getMessage() for r in caplog.records if "POST /api/chat" in r.getMessage()]
    assert said, [r.getMessage() for r in caplog.records]
    assert all("(ollama door)" in line and "context" in line and "(no reason given)" not in line for line in said)
