"""Each door encodes a turn's typed events (daemon/events.py) itself: no door reads the websocket's frames,
and the websocket's writer hands the first token off only once it has sent it.

The rule, read from every module's source with `ast` (tests/test_arrows.py's
`imported`, so an import in a function counts too): a module in daemon/doors/
other than the websocket door's own (WEBSOCKET_DOOR) may not

- import `protocol.wire` or `protocol.encode` (the websocket's objects and its encoder),
- name one of protocol's event types (`p.CHAT_DELTA`, `from protocol import ERROR`, ...),
- or spell a turn's frame type as a string (``"chat.delta"``).

protocol's error codes (`p.TOO_LARGE`), its request parser and its shapes
stay open to every door: they are a turn's refusals and parameters, not its
events' wire format.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

import protocol
from test_arrows import imported

ROOT = Path(__file__).resolve().parent.parent
# The websocket door: its frames are protocol's (loading.py writes the `loading`/`ready`/`error` frames
# that end a client's wait for the model, no turn's).
WEBSOCKET_DOOR = frozenset({"websocket.py", "connection.py", "loading.py"})
# protocol's event types (docs/protocol.md, "Events"): the names of the websocket's frames.
EVENT_NAMES = frozenset({"HELLO", "SESSION", "SESSIONS", "CHAT_START", "CHAT_QUEUED", "CHAT_PROGRESS", "CHAT_DELTA",
                         "CHAT_DONE", "CHAT_ATTACHED", "LOADING", "READY", "OK", "PONG", "ERROR"})
WIRE = frozenset({"wire", "encode"})
# A turn's frame types as strings ("chat.delta"): a door comparing with these reads another door's frames.
TURN_FRAMES = frozenset(getattr(protocol, n) for n in EVENT_NAMES if n.startswith("CHAT_"))


def readings(path: Path, module: str) -> list[str]:
    """Each place `path` reads the websocket's event frames, as `line: what`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = [f"{line}: imports {name}" for line, name in imported(tree, module)
             if name in ("protocol.wire",) or name.startswith("protocol.wire.")]
    aliases = set()  # the names protocol itself is bound to in this module (`import protocol as p`)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "protocol"}
        elif isinstance(node, ast.ImportFrom) and node.module == "protocol" and not node.level:
            found += [f"{node.lineno}: imports protocol.{a.name}" for a in node.names
                      if a.name in EVENT_NAMES | WIRE]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr in EVENT_NAMES | WIRE):
            found.append(f"{node.lineno}: names {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in TURN_FRAMES:
            found.append(f"{node.lineno}: spells {node.value!r}")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def doors_reading_frames(root: Path) -> list[str]:
    wrong = []
    for path in sorted((root / "daemon" / "doors").rglob("*.py")):
        if path.name in WEBSOCKET_DOOR and path.parent == root / "daemon" / "doors":
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        wrong += [f"{path.relative_to(root)}:{r}" for r in readings(path, module)]
    return wrong


def test_the_names_are_protocols() -> None:
    assert all(isinstance(getattr(protocol, n, None), str) for n in EVENT_NAMES)
    assert callable(protocol.encode) and TURN_FRAMES >= {"chat.delta", "chat.done", "chat.start"}


def test_no_door_but_the_websocket_reads_protocol_frames() -> None:
    assert (ROOT / "daemon" / "doors" / "openai_answer.py").is_file()
    assert doors_reading_frames(ROOT) == []


@pytest.mark.parametrize("source, found", [
    ("import protocol as p\ndef f(e):\n    return e['type'] == p.CHAT_DELTA\n", "3: names p.CHAT_DELTA"),
    ("def f(e):\n    from protocol import ERROR\n    return e['type'] == ERROR\n", "2: imports protocol.ERROR"),
    ("from protocol import wire\n", "1: imports protocol.wire"),
    ("import protocol.wire\n", "1: imports protocol.wire"),
    ("import protocol\nx = protocol.encode({})\n", "2: names protocol.encode"),
    ("def f(e):\n    return e['type'] == 'chat.done'\n", "2: spells 'chat.done'"),
])  # fmt: skip
def test_a_door_reading_frames_is_found(tmp_path: Path, source: str, found: str) -> None:
    doors = tmp_path / "daemon" / "doors"
    doors.mkdir(parents=True)
    allowed = "import protocol as p\nfrom protocol.requests import RequestError\ncode = p.TOO_LARGE\n"
    (doors / "responses.py").write_text(allowed + source)
    (doors / "websocket.py").write_text("import protocol as p\nfrom protocol import wire\nt = p.CHAT_DELTA\n")
    shift = allowed.count("\n")
    line, what = found.split(": ", 1)
    assert doors_reading_frames(tmp_path) == [f"daemon/doors/responses.py:{int(line) + shift}: {what}"]


class _SlowSocket:
    """A websocket whose client reads a frame only when the test lets it."""

    client = ("127.0.0.1", 1)

    def __init__(self) -> None:
        self.gate = anyio.Event()
        self.sent: list[str] = []

    async def send_text(self, frame: str) -> None:
        await self.gate.wait()
        self.sent.append(frame)


@pytest.mark.anyio
async def test_the_websocket_hands_the_first_token_off_once_it_has_sent_it() -> None:
    from daemon.doors.connection import Connection
    from daemon.events import AnswerDelta, AnswerStarted
    from daemon.turn import Turn

    ws = _SlowSocket()
    conn = Connection(cast(Any, ws), send_timeout=5.0, abort=lambda: None)
    handed: list[int] = []
    turn = Turn(7, "0123456789abcdef", 3, 2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(conn.writer)
        conn.hear(turn, AnswerStarted(3))
        conn.hear(turn, AnswerDelta(0, "Hi", lambda: handed.append(len(ws.sent))))
        for _ in range(10):  # the writer has had every chance to run: it waits on the client
            await anyio.lowlevel.checkpoint()
        assert handed == [] and ws.sent == []
        ws.gate.set()
        with anyio.fail_after(5):
            while not handed:
                await anyio.lowlevel.checkpoint()
        assert handed == [2]  # called right after the delta's own frame went out
        assert ws.sent[1] == '{"id":7,"session":"0123456789abcdef","type":"chat.delta","seq":0,"text":"Hi"}'
        # A client already gone: nothing will be sent, so the hand-off is at once.
        conn.close()
        conn.hear(turn, AnswerDelta(1, "!", lambda: handed.append(-1)))
        assert handed == [2, -1]
        tg.cancel_scope.cancel()
