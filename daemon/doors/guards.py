"""Who may talk to kvd: the checks both front doors run on every request, before anything else.

Pure functions of the request's headers and the config, so the websocket
handshake and the HTTP API cannot drift apart:

- Host: a loopback name, the address kvd listens on, or one listed in
  `server.allowed_hosts`. A web page can point its own domain at 127.0.0.1
  (DNS rebinding) and so reach a loopback port "same-origin"; the browser
  still sends that domain as Host, and it is refused here.
- Origin: browsers send it; none is allowed unless listed in
  `server.allowed_origins`. Non-browser clients send none.
- Token: `Authorization: Bearer <token>` (the token file in the data
  directory; OpenAI clients send their API key exactly so) or
  `x-api-key: <token>` (as Anthropic's clients send theirs), compared in
  constant time. Only `GET /` and `HEAD /` go without one (`public`): they
  say that kvd runs and nothing more, as llama-server's and Ollama's roots
  do, and clients probe them without a key (Claude Code sends `HEAD /`
  before each run); so does `GET /health` (ready or not, nothing else).
  The Host and Origin checks still apply to them.
- Ollama's API (`/api/...`): many of its clients cannot send a token, so with
  [api] ollama_token = "loopback" (the default) a request from a loopback
  peer address that sends no credentials passes the token check, but for
  `/api/pull` and `/api/delete` (`token_needed`). The Host and Origin checks
  are what keep a web page out (a browser always sends the page's Origin on
  a POST or DELETE, and the rebinding domain as Host), as they do for the
  websocket; a remote peer (kvd listening beyond loopback) needs the token.

`asked` says in a log line who asked for what (a refusal, a 404), so an
operator can tell which client is misconfigured; a door that answers 404
because kvd serves no such path marks the request (`NO_ROUTE`), so the log
tells that apart from a 404 for something a served path names (an unknown
response id, session or model).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from ..config import Config

LOOPBACK_NAMES = ("localhost",)
NO_ROUTE = "kvd.no_route"  # set in a request's ASGI scope by the door that found no path for it
LOGGED_CHARS = 200  # of a path or User-Agent in a log line


@dataclass(frozen=True)
class GuardRefusal:
    status: HTTPStatus
    message: str  # what is wrong and what to do, for a person reading a client's error


def host_name(host_header: str) -> str:
    """The name part of a Host header: `[::1]:8765` -> `::1`, `localhost:80` -> `localhost`."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def host_allowed(host_header: str | None, config: Config) -> bool:
    if not host_header:
        return False
    name = host_name(host_header)
    if name in LOOPBACK_NAMES or name in (h.lower() for h in config.allowed_hosts):
        return True
    if name == config.host.lower() and config.host not in ("0.0.0.0", "::"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def public(method: str, path: str) -> bool:
    """Whether a request may come without the token: the root's probe, which learns only that kvd runs, and
    the health check, which learns only whether it is ready."""
    return path in ("/", "/health") and method in ("GET", "HEAD")


OLLAMA_PREFIX = "/api/"
# What changes the disk (a model fetched, a model's files removed) always needs the token.
OLLAMA_WRITES = frozenset({"/api/pull", "/api/delete"})


def peer_is_loopback(peer: str | None) -> bool:
    """Whether the connection comes from this machine (its address, not its Host header, which a client writes)."""
    try:
        address = ipaddress.ip_address(peer or "")
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool((mapped or address).is_loopback)


def token_needed(method: str, path: str, headers: Mapping[str, str], peer: str | None, config: Config) -> bool:
    """Whether this request must carry the token (the Host and Origin checks apply to every request).

    Without it: the root and /health (`public`); /metrics when [api] metrics_public says so; and, with [api]
    ollama_token = "loopback", Ollama's API from a loopback peer that sends no credentials at all (Ollama's
    clients often cannot), but for pull and delete. A request that sends a token must send the right one.
    """
    if public(method, path) or (path == "/metrics" and config.metrics_public):
        return False
    if (config.ollama_token == "loopback" and path.startswith(OLLAMA_PREFIX) and path not in OLLAMA_WRITES
            and "authorization" not in headers and "x-api-key" not in headers):
        return not peer_is_loopback(peer)
    return True


def check(headers: dict[str, str], config: Config, token: str, *, token_needed: bool = True) -> GuardRefusal | None:
    """The first reason to refuse a request with these (lower-cased) headers, or None."""
    if not host_allowed(headers.get("host"), config):
        return GuardRefusal(HTTPStatus.FORBIDDEN,
                       f"Host {headers.get('host')!r} is not allowed: kvd answers to loopback names "
                       "and the hosts listed in server.allowed_hosts in config.toml")
    origin = headers.get("origin")
    if origin is not None and origin not in config.allowed_origins:
        return GuardRefusal(HTTPStatus.FORBIDDEN,
                       "browser origins are not allowed; see allowed_origins in config.toml")
    if not token_needed:
        return None
    bearer = hmac.compare_digest(headers.get("authorization", "").encode(), f"Bearer {token}".encode())
    api_key = hmac.compare_digest(headers.get("x-api-key", "").encode(), token.encode())
    if not (bearer or api_key):
        return GuardRefusal(HTTPStatus.UNAUTHORIZED,
                       "missing or wrong token; it is in the token file of kvd's data directory")
    return None


def asked(scope: Mapping[str, Any]) -> str:
    """`POST /v1/messages from 127.0.0.1:52344 (User-Agent 'claude-cli/1.0')`: what a log line says a
    client asked for. The path and the agent are the client's bytes: non-printable characters escaped."""
    method = str(scope.get("method", "GET")) if scope.get("type") == "http" else "websocket"
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "an unknown client"
    agent = next((v for k, v in scope.get("headers", ()) if k.lower() == b"user-agent"), None)
    said = f" (User-Agent '{_printable(agent.decode('latin-1'))}')" if agent else ""
    return f"{method} {_printable(str(scope.get('path', '?')))} from {who}{said}"


def _printable(text: str) -> str:
    text = text[:LOGGED_CHARS] + ("…" if len(text) > LOGGED_CHARS else "")
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
