"""The kvd wire protocol, v1: names and defaults shared by the daemon and kvchat.

A leaf package: it imports no other kvd package (tests/test_arrows.py checks),
so kvchat can import it and never pull in mlx, the engine or the stores.
Standard library only. docs/protocol.md is the reference for every type and
field named here; `protocol.requests` parses the frames a client sends and
`protocol.wire` builds the objects the daemon sends back. `protocol.shapes`
(a turn's parameters, one rule each) and `protocol.requests` import pydantic:
only the daemon imports them, so kvchat starts without it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# Facts the wire shares with every package (re-exported: the wire speaks them).
from common.ids import SESSION_ID_RE as SESSION_ID_RE
from common.tiers import NO_CACHE as NO_CACHE
from common.tiers import SHARED as SHARED
from common.tiers import TIERS as TIERS

PROTOCOL_VERSION = 1
PATH = "/v1"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765

# Files in the data directory that a client reads to find the daemon.
TOKEN_FILE = "token"
DAEMON_FILE = "daemon.json"

# Request types.
SESSION_CREATE = "session.create"
SESSION_LIST = "session.list"
SESSION_GET = "session.get"
SESSION_UPDATE = "session.update"
SESSION_DELETE = "session.delete"
CHAT_SEND = "chat.send"
CHAT_REGENERATE = "chat.regenerate"
CHAT_EDIT = "chat.edit"
CHAT_CANCEL = "chat.cancel"
CHAT_ATTACH = "chat.attach"
PING = "ping"
STATUS = "status"

# Event types.
HELLO = "hello"
SESSION = "session"
SESSIONS = "sessions"
CHAT_START = "chat.start"
CHAT_QUEUED = "chat.queued"
CHAT_PROGRESS = "chat.progress"  # how far a long prefill has got, at most a few a second
CHAT_DELTA = "chat.delta"
CHAT_DONE = "chat.done"
CHAT_ATTACHED = "chat.attached"
LOADING = "loading"  # pushed about once a second while the model loads
READY = "ready"  # pushed once when the model has loaded
OK = "ok"
PONG = "pong"
ERROR = "error"

# Error codes (docs/protocol.md, "Errors").
BAD_JSON = "bad_json"
BAD_REQUEST = "bad_request"
UNKNOWN_TYPE = "unknown_type"
UNKNOWN_SESSION = "unknown_session"
UNKNOWN_MODEL = "unknown_model"  # a model name kvd cannot serve (`kvd models` lists those it can)
TOO_LARGE = "too_large"
BUSY = "busy"
DISK_FULL = "disk_full"
INTERNAL = "internal"



# The title of a session created without one.
DEFAULT_TITLE = "New chat"

# Earlier turns a new session may start with (session.create's `messages`): validated on the event loop,
# so bounded (2,000 took ~15 ms; the 1 MiB frame's ~28,000 took 0.2 s, a stall for every other client).
MAX_CARRIED = 2000

# Per-session generation defaults a session.update may set ("params").
PARAMS = ("temperature", "top_p", "max_tokens")


def default_data_dir() -> Path:
    """`$KVD_DATA_DIR`, else `$XDG_DATA_HOME/kvd`, else `~/.local/share/kvd`."""
    if env := os.environ.get("KVD_DATA_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or "~/.local/share"
    return Path(base).expanduser() / "kvd"


def default_url(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> str:
    return f"ws://{host}:{port}{PATH}"


def api_url(ws_url: str) -> str:
    """The OpenAI-compatible API's base URL on the same port: ws://h:p/v1 -> http://h:p/v1."""
    return "http" + ws_url.removeprefix("ws") if ws_url.startswith("ws") else ws_url


def read_daemon_url(data_dir: Path) -> str | None:
    """The URL a running daemon wrote to its data directory, if any."""
    try:
        info = json.loads((data_dir / DAEMON_FILE).read_text())
    except (OSError, ValueError):
        return None
    url = info.get("url") if isinstance(info, dict) else None
    return url if isinstance(url, str) else None


def running_daemon_url(data_dir: Path) -> str | None:
    """The URL in the data directory's daemon.json while the pid it names is alive (the file outlives kvd)."""
    url = read_daemon_url(data_dir)
    try:
        pid = json.loads((data_dir / DAEMON_FILE).read_text()).get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    if url is None or not isinstance(pid, int):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's process holds that pid: alive, if not necessarily kvd
    return url


def nothing_answers(url: str, data_dir: Path) -> str:
    """"nothing answers at URL", and where kvd really runs when the data directory knows it."""
    said = f"nothing answers at {url}"
    running = running_daemon_url(data_dir)
    if running is not None and running != url:
        said += f"; kvd runs at {running} (from {data_dir / DAEMON_FILE}): leave out --url, or pass that one"
    return said


def encode(message: dict[str, Any]) -> str:
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"))
