"""The chat loop: read a message or a /command, stream the answer, show the status line.

Threads: this runs on the main thread (prompt, Ctrl-C, printing); the client
runs on the network thread (loop_thread.py) and is reached through
``net.run``. Which session is open, and which sessions the last table showed
(what "/switch 2" means), is this module's state.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

import protocol

from . import commands, listing, render
from .chatview import ChatOptions
from .client import Client
from .errors import KvchatError, ServerError
from .estimate import PrefillClock
from .interrupts import Interrupts
from .lineinput import Input
from .link import Link
from .listing import ORIGIN
from .loop_thread import LoopThread
from .turn import RECONNECTED, RECONNECTING, TurnRunner

COPY_FILE = "kvchat-copy.txt"
PICK = "number or title, Enter for a new chat: "
FULL_HINT = ("the session is full. /params max_tokens=N lowers the answer's room if that is enough; "
             "/compact goes on in a new session that carries the system prompt and the last turns "
             "that fit in half the context")
TOO_MANY_CHARS_HINT = ("send it in parts (Up recalls it; Ctrl-O edits it in $EDITOR), or raise limits.max_text_chars "
                       "in kvd's config.toml and restart kvd")
# kvd's refusal (daemon/turns.py): how many tokens the conversation would be, the answer's room, the context.
FULL_REFUSAL = re.compile(r"the conversation \((\d+) tokens\) plus max_tokens \((\d+)\) exceeds the model's "
                          r"context of (\d+) tokens")
# A message that does not fit on its own: no earlier turn to leave behind, so /compact cannot help.
TOO_LONG_ALONE_HINT = ("the message alone is longer than the model's context: send a part of it at a time, or "
                       "use a model with a longer context (/model)")
TOO_LONG_HINT = ("the message itself does not fit with the answer's room: send a shorter one (or a part of it "
                 "at a time), or lower /params max_tokens=N if a short answer is enough")


class Chat:
    """One terminal's conversation with kvd, across the sessions it switches between."""

    def __init__(
        self,
        console: Console,
        net: LoopThread,
        link: Link,
        interrupts: Interrupts,
        input: Input,
        options: ChatOptions | None = None,
    ) -> None:
        self.console = console
        self.net = net
        self.link = link
        self.interrupts = interrupts
        self.input = input
        self.clock = PrefillClock()  # every answer's reading estimate also learns from the reads before it
        self.options = options or ChatOptions()
        self.session: dict[str, Any] = {}
        self.listed: list[dict[str, Any]] = []  # the rows of the last sessions table shown
        self.hidden_one_shots = 0  # one-shots that table left out
        self.last_index = -1  # the open session's last message
        self.group: list[str] = []  # the open session, and the branches its listed row stands for with it
        self._created: set[str] = set()  # sessions this run created (an empty one is not kept)
        self.prompt = render.prompt(console, render.YOU, render.YOU_STYLE)
        self.continuation = render.prompt(console, render.CONTINUE, render.DIM)

    @property
    def session_id(self) -> str:
        return str(self.session["id"])

    # -- the loop -----------------------------------------------------------------

    def run(self) -> int:
        """Until /quit or Ctrl-D."""
        try:
            while True:
                try:
                    text = self.input.message(self.prompt, self.continuation)
                    stripped = text.strip()
                    if not stripped:
                        continue
                    if commands.is_command(stripped):
                        if commands.dispatch(self, stripped):
                            return 0
                        continue
                    text = text.strip("\n")
                    self.send(text[1:] if stripped.startswith("//") else text)
                except KeyboardInterrupt:  # what was typed is dropped; say so and prompt afresh
                    self.input.interrupted()
                except EOFError:
                    self.console.print()
                    return 0
                except ServerError as exc:  # this request failed; the chat goes on
                    if exc.code == protocol.UNKNOWN_SESSION and self.session and not self.session_exists():
                        if not self.deleted_elsewhere():
                            return 0
                        continue
                    if exc.code == protocol.TOO_LARGE and "context" in exc.message:
                        render.print_error(self.console, exc.message)
                        render.print_note(self.console, self.full_hint(exc.message))
                        continue
                    if exc.code == protocol.TOO_LARGE and "characters" in exc.message:
                        render.print_error(self.console, exc.message)
                        render.print_note(self.console, TOO_MANY_CHARS_HINT)
                        continue
                    busy = ("this session is answering right now (in another window?); /attach to watch it, "
                            "Ctrl-C there stops it; or wait for it to finish")
                    render.print_error(self.console, busy if exc.code == protocol.BUSY else str(exc))
                except KvchatError as exc:
                    render.print_error(self.console, str(exc))
                except Exception as exc:  # a bug in kvchat: say so, and keep the chat
                    render.print_error(self.console, f"kvchat hit a bug ({type(exc).__name__}: {exc}); "
                                       "the chat goes on")
        finally:
            with contextlib.suppress(Exception, KeyboardInterrupt):
                self.leave()

    def send(self, text: str) -> None:
        named = self.name_after(text)
        model = {"model": self.options.model} if self.options.model else {}
        try:
            reply = self.turn(protocol.CHAT_SEND, text=text, **model)
        except ServerError:
            if named and self.last_index < 0:  # refused, nothing kept: not titled after what is not there
                with contextlib.suppress(KvchatError):
                    self.session = self.request(protocol.SESSION_UPDATE, session=self.session_id,
                                                title=protocol.DEFAULT_TITLE)["session"]
            raise
        if model and reply is not None:
            self.session["model"] = self.options.model  # the daemon switched the session to it

    @property
    def copy_file(self) -> Path:
        """Where /copy also keeps what it copied (next to kvchat's history)."""
        return (self.link.data_dir or protocol.default_data_dir()) / COPY_FILE

    def turn(self, kind: str, **fields: Any) -> dict[str, Any] | None:
        """Ask for an answer (or follow one) and print it; its chat.done, if it got one."""
        if kind != protocol.CHAT_ATTACH:
            fields = {**self.options.fields(), **fields}
        self.wait_ready()
        done = TurnRunner(self.console, self.net, self.link, self.interrupts, self.session_id, kind, fields,
                    last_index=self.last_index, clock=self.clock).run()
        if done is not None and isinstance(done.get("message_index"), int):
            self.last_index = done["message_index"]
        return done

    # -- talking to kvd ---------------------------------------------------------

    def request(self, type_: str, **fields: Any) -> dict[str, Any]:
        """One request; a dropped connection is made again first."""
        return self.net.run(self._request(type_, fields))

    async def _request(self, type_: str, fields: dict[str, Any]) -> dict[str, Any]:
        client = await self._client()
        return await client.request(type_, **fields)

    def wait_ready(self) -> None:
        """A spinner while the daemon's model loads (requests would wait silently)."""
        client = self.net.run(self._client())
        if client.ready:
            return
        model = render.sanitize(str(client.hello.get("model", "the model")))
        if not self.console.is_terminal:  # no spinner to draw: say it once
            render.print_note(self.console, f"waiting for kvd to finish loading model {model}…")
            self.net.run(client.wait_ready())
            return
        with self.console.status(f"loading model {model}…") as status:

            def progress(loading: Mapping[str, Any]) -> None:  # network thread
                elapsed = loading.get("elapsed_s")
                stage = render.sanitize(str(loading.get("stage") or f"loading {model}"))
                status.update(f"{stage}… {elapsed:.1f} s" if isinstance(elapsed, (int, float)) else f"{stage}…")

            self.net.run(client.wait_ready(progress))

    async def _client(self) -> Client:
        """The connection, made again (and said so) if it dropped since the last request."""
        lost = self.link.client.lost
        client = await self.link.ensure(on_retry=lambda: render.print_note(self.console, RECONNECTING))
        if lost:
            render.print_note(self.console, RECONNECTED)
        return client

    # -- sessions ------------------------------------------------------------------

    def open(self, *, session_id: str | None = None, last: bool = False, new: bool = False,
             title: str | None = None, system: str | None = None, origin: str | None = None,
             everything: bool = False) -> bool:
        """Choose the session to start in; False if the user left at the picker."""
        if session_id is not None:
            if not protocol.SESSION_ID_RE.fullmatch(session_id):
                raise KvchatError(f"{session_id!r} is not a session id (16 hex characters, shown when a chat starts)")
            try:
                self.switch(session_id)
            except ServerError as exc:
                if exc.code == protocol.UNKNOWN_SESSION:
                    raise KvchatError(f"no session {session_id}; `kvchat --last` resumes the most recent one, "
                                      "`kvchat` lists them") from exc
                raise
            return True
        if new:
            self.create(title=title, system=system)
            return True
        if last:  # the last chat typed in: kvchat's own, not a one-shot (unless --from says otherwise)
            every = self.all_sessions()
            sessions = listing.chats(every) if origin is None else listing.made_by(every, origin)
        else:
            sessions = self.list_sessions(origin=origin, everything=everything)
        if last:
            if sessions:
                self.switch(sessions[0]["id"])
            else:
                render.print_note(self.console, "no earlier session; starting a new one")
                self.create(title=title, system=system)
            return True
        if not sessions:
            self.create(title=title, system=system)
            return True
        return self.pick(sessions, title=title, system=system)

    def pick(self, sessions: Sequence[Mapping[str, Any]], *, title: str | None = None,
             system: str | None = None) -> bool:
        """The sessions table and a question: which one (Enter: a new chat); False if input ended."""
        self.console.print(listing.sessions_table(sessions, width=self.console.width), soft_wrap=True)
        if self.hidden_one_shots:
            render.print_note(self.console, f"({self.hidden_one_shots} one-shot"
                              f"{'' if self.hidden_one_shots == 1 else 's'} not listed: kvchat --all lists them)")
        while True:
            try:
                answer = self.input.ask(PICK).strip()
            except EOFError:
                self.console.print()
                return False
            if not answer:
                self.create(title=title, system=system)
                return True
            found = listing.find(sessions, answer)
            if isinstance(found, str):
                render.print_note(self.console, found)
                continue
            self.switch(str(found["id"]))
            return True

    def all_sessions(self) -> list[dict[str, Any]]:
        """Every session, most recently used first."""
        return list(self.request(protocol.SESSION_LIST).get("sessions") or [])

    def list_sessions(self, *, origin: str | None = None, everything: bool = False) -> list[dict[str, Any]]:
        """The table's rows, what its numbers count (listing.rows): an API conversation's branches as one,
        one-shots left out (counted in `hidden_one_shots`) unless `everything` or --from one-shot."""
        made = listing.made_by(self.all_sessions(), origin or "any")
        one_shots = origin == "one-shot"
        self.hidden_one_shots = 0 if everything or one_shots else listing.hidden_one_shots(made)
        self.listed = listing.rows(made, everything=everything, one_shots=one_shots)
        return self.listed

    def switch(self, session_id: str) -> None:
        """Open a session; one a listed row stands for with its branches (an API conversation's retries
        and edits) under that row's title, the conversation's: what the user picked is what the header says."""
        got = self.request(protocol.SESSION_GET, session=session_id)
        if self.session and self.session_id != session_id:
            self.leave()
        session = got["session"]
        row = next((r for r in self.listed if session_id in (r.get("members") or ()) and len(r["members"]) > 1), None)
        if row is not None:
            session = {**session, "title": row.get("title") or session.get("title")}
        self.show(session, got.get("messages") or [], resumed=True)
        if row is not None:
            self.group = list(row["members"])
            n = len(self.group) - 1
            render.print_note(self.console, f"this API conversation has {n} more branch{'' if n == 1 else 'es'} (a "
                              "retry or an edited message each); this is the most recently used one; /sessions "
                              "all lists each")

    def create(self, *, title: str | None = None, system: str | None = None) -> None:
        fields = {k: v for k, v in (("title", title), ("system", system), ("model", self.options.model))
                  if v is not None}
        session = self.request(protocol.SESSION_CREATE, origin=ORIGIN, **fields)["session"]
        if self.session:
            self.leave()
        self._created.add(session["id"])
        self.show(session, [], resumed=False)

    def show(self, session: dict[str, Any], messages: Sequence[Mapping[str, Any]], *, resumed: bool) -> None:
        self.session = session
        self.group = [str(session["id"])]
        self.last_index = int(messages[-1]["index"]) if messages else -1
        render.print_header(self.console, session, self.link.client.hello, resumed=resumed)
        render.print_history(self.console, messages, recent=render.RECENT_TURNS)

    def adopt(self, session: dict[str, Any], *, messages: Sequence[Mapping[str, Any]] = ()) -> None:
        """Open a session this run made with content of its own (/compact's: the turns it carries)."""
        if self.session:
            self.leave()
        self.show(session, messages, resumed=False)

    def name_after(self, text: str) -> bool:
        """A new chat is titled after its first message, so the sessions list says what it was about;
        whether it was."""
        if self.last_index >= 0 or self.session.get("title") != protocol.DEFAULT_TITLE:
            return False
        title = listing.one_line(text, listing.TITLE_CHARS)
        if title:
            with contextlib.suppress(KvchatError):
                self.session = self.request(protocol.SESSION_UPDATE, session=self.session_id, title=title)["session"]
                return True
        return False

    def session_exists(self) -> bool:
        try:
            self.request(protocol.SESSION_GET, session=self.session_id)
        except ServerError as exc:
            if exc.code == protocol.UNKNOWN_SESSION:
                return False
            raise
        return True

    def deleted_elsewhere(self) -> bool:
        """The open session is gone (deleted in another window): say so, then pick another or a new one."""
        title = render.sanitize(str(self.session.get("title") or self.session_id))
        render.print_note(self.console, f"this session ({title!r}) was deleted, in another window or by "
                                        "another client; what you sent was not kept (Up recalls it)")
        self.forget_current()
        sessions = self.list_sessions()
        if not sessions:
            render.print_note(self.console, "here is a new chat")
            self.console.print()
            self.create()
            return True
        return self.pick(sessions)

    def full_hint(self, refusal: str) -> str:
        """What to do about a turn that does not fit the context: /compact, or a shorter message (and a
        smaller answer's room only where that could be enough: not for a message longer than the context)."""
        if self.compact_helps(refusal):
            return FULL_HINT
        said = FULL_REFUSAL.search(refusal)
        if said is not None and int(said[1]) >= int(said[3]):
            return TOO_LONG_ALONE_HINT
        return TOO_LONG_HINT

    def compact_helps(self, refusal: str) -> bool:
        """Whether /compact could make room: the session holds an answer to leave behind, and the new
        message fits the context on its own (a 10000-token paste into an 8192-token
        context does not fit however little history is carried)."""
        got = self.request(protocol.SESSION_GET, session=self.session_id)
        answers = [m for m in got.get("messages") or [] if m.get("role") == "assistant" and m.get("content")]
        if not answers:
            return False
        said = FULL_REFUSAL.search(refusal)
        used = (answers[-1].get("usage") or {}).get("context_tokens")
        if said is None or not isinstance(used, int):
            return True
        conversation, _room, context = (int(n) for n in said.groups())
        return conversation - used < context  # the answer's room can still be lowered (FULL_HINT says so)

    def forget_current(self) -> None:
        """The open session was deleted."""
        self._created.discard(self.session_id)
        self.session = {}

    def leave(self) -> None:
        """A new chat this run opened and never used is not kept (no messages, title, system or params)."""
        if not self.session or self.session_id not in self._created or self.link.client.lost:
            return
        self._created.discard(self.session_id)
        with contextlib.suppress(KvchatError):
            got = self.request(protocol.SESSION_GET, session=self.session_id)["session"]
            if (got.get("message_count") == 0 and got.get("title") == protocol.DEFAULT_TITLE and not got.get("system")
                    and not got.get("params")):
                self.request(protocol.SESSION_DELETE, session=self.session_id)
