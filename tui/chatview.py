"""What the /commands and /compact see of a chat: a Protocol, so they need not import the chat loop.

`repl.Chat` implements it; commands.py and compact.py type against it, and
repl.py imports them: the arrows run one way (repl -> commands -> chatview).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from .lineinput import Input
from .link import Link


@dataclass(frozen=True)
class ChatOptions:
    """Generation settings from kvchat's flags: sent with every turn, over the session's params."""

    max_tokens: int | None = None
    temperature: float | None = None
    model: str | None = None  # --model or /model: new sessions are made with it, and each message asks for it

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in (("max_tokens", self.max_tokens), ("temperature", self.temperature)) if v is not None}


class ChatView(Protocol):
    console: Console
    link: Link
    input: Input
    options: ChatOptions
    session: dict[str, Any]
    listed: list[dict[str, Any]]
    group: list[str]  # the open session and the API conversation's other branches its listed row stood for
    continuation: str

    @property
    def session_id(self) -> str: ...

    @property
    def copy_file(self) -> Path: ...

    def request(self, type_: str, **fields: Any) -> dict[str, Any]: ...

    def turn(self, kind: str, **fields: Any) -> dict[str, Any] | None: ...

    def send(self, text: str) -> None: ...

    hidden_one_shots: int

    def list_sessions(self, *, origin: str | None = None, everything: bool = False) -> list[dict[str, Any]]: ...

    def switch(self, session_id: str) -> None: ...

    def create(self, *, title: str | None = None, system: str | None = None) -> None: ...

    def adopt(self, session: dict[str, Any], *, messages: Sequence[Mapping[str, Any]] = ()) -> None: ...

    def forget_current(self) -> None: ...
