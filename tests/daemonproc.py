"""A real `kvd serve` process, for the restart and crash tests."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

START_TIMEOUT = 120.0
EVENT_TIMEOUT = 60.0


class DaemonProcess:
    def __init__(self, data_dir: Path, *args: str, env: dict[str, str] | None = None, prefetch: bool = False,
                 block_tokens: int | None = None, crash_at: str | None = None):
        """`kvd serve` on port 0; on builtin:tiny unless `args` name a --model; dying like kill -9
        at the cache writer's point `crash_at` if given (tests/crashing_kvd.py)."""
        self.data_dir = data_dir
        if "--model" not in args:
            args = ("--model", "builtin:tiny", *args)
        # A restart in a test is cold (restored from disk) unless the test asks for prefetch.
        if "--config" not in args:
            config = data_dir.parent / f"{data_dir.name}-kvd.toml"
            blocks = f"block_tokens = {block_tokens}\n" if block_tokens else ""
            config.write_text(f"[cache]\nprefetch = {str(prefetch).lower()}\n{blocks}")
            args = ("--config", str(config), *args)
        self.proc = subprocess.Popen(
            [sys.executable, *(["-m", "daemon.cli"] if crash_at is None else
                               [str(Path(__file__).with_name("crashing_kvd.py")), crash_at]),
             "serve", "--port", "0", "--data-dir", str(data_dir), *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})},
        )
        self.log: list[str] = []
        lines: queue.Queue[str | None] = queue.Queue()

        def drain() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line)
                lines.put(line)
            lines.put(None)

        threading.Thread(target=drain, daemon=True).start()
        while True:
            try:
                line = lines.get(timeout=START_TIMEOUT)
            except queue.Empty:
                self.proc.kill()
                raise AssertionError("kvd serve did not start:\n" + "".join(self.log)) from None
            if line is None:
                raise AssertionError(f"kvd serve exited with {self.proc.wait()}:\n" + "".join(self.log))
            if m := re.search(r"listening on (ws://\S+)", line):
                self.url = m.group(1)
                break
        self.token = (data_dir / "token").read_text().strip()

    @property
    def base_url(self) -> str:
        """Where OpenAI clients find the daemon: the same port, over HTTP."""
        return self.url.replace("ws://", "http://", 1)

    @contextmanager
    def client(self) -> Iterator[SyncClient]:
        with connect(self.url, additional_headers={"Authorization": f"Bearer {self.token}"},
                     max_size=None) as ws:
            c = SyncClient(ws)
            hello = c.recv()
            assert hello["type"] == "hello"
            while not hello["ready"]:  # the model is loading: wait for it, so tests see only their replies
                event = c.recv()
                assert event["type"] in ("loading", "ready"), event
                hello["ready"] = event["type"] == "ready"
            yield c

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)

    def kill(self) -> int:
        self.proc.kill()
        return self.proc.wait(timeout=60)


class SyncClient:
    def __init__(self, ws: ClientConnection):
        self.ws = ws
        self.n = 0

    def recv(self) -> dict[str, Any]:
        event: dict[str, Any] = json.loads(self.ws.recv(timeout=EVENT_TIMEOUT))
        return event

    def send(self, **frame: Any) -> str:
        self.n += 1
        frame.setdefault("id", f"r{self.n}")
        self.ws.send(json.dumps(frame))
        return str(frame["id"])

    def request(self, type: str, **fields: Any) -> dict[str, Any]:
        rid = self.send(type=type, **fields)
        while True:
            reply = self.recv()
            if reply.get("id") == rid:
                return reply

    def chat(self, session: str, text: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        rid = self.send(type="chat.send", session=session, text=text, **fields)
        out = ""
        while True:
            e = self.recv()
            if e.get("id") != rid:
                continue
            if e["type"] == "chat.delta":
                out += e["text"]
            elif e["type"] in ("chat.done", "error"):
                return out, e
