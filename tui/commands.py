"""The /commands: each one's usage line, what it does, and the code behind it.

A command that gets arguments it cannot use prints its usage line; one the
daemon refuses prints the daemon's reason (a KvchatError, caught by the chat
loop). Nothing typed here ends kvchat but /quit, /exit and /bye.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

import protocol

from . import clipboard, compact, export, listing, render
from .chatview import ChatView


class UsageError(Exception):
    """The arguments do not fit; the message says why (the usage line follows it)."""


@dataclass(frozen=True)
class Command:
    usage: str
    help: str
    run: Callable[[ChatView, str], bool | None]  # True: leave kvchat


COMMANDS: dict[str, Command] = {}


def command(name: str, usage: str, help: str) -> Callable[[Callable[[ChatView, str], bool | None]],
                                                          Callable[[ChatView, str], bool | None]]:
    def register(fn: Callable[[ChatView, str], bool | None]) -> Callable[[ChatView, str], bool | None]:
        COMMANDS[name] = Command(usage, help, fn)
        return fn

    return register


def is_command(text: str) -> bool:
    """Whether a message is a /command: it starts with one "/" and, when it is a paste of several
    lines, with a command kvchat knows (so a pasted path or log is sent as a message)."""
    if not text.startswith("/") or text.startswith("//"):
        return False
    return "\n" not in text or text.split(None, 1)[0].lower() in COMMANDS


def dispatch(chat: ChatView, text: str) -> bool:
    """Run one /command line; True means leave."""
    head, _, args = text.partition(" ")
    if "\n" in head:
        head, _, more = head.partition("\n")
        args = more + (" " + args if args else "")
    name = head.lower()
    cmd = COMMANDS.get(name)
    if cmd is None:
        render.print_note(chat.console, f"unknown command {head}; /help lists them (// sends text that starts with /)")
        return False
    try:
        return bool(cmd.run(chat, args.strip()))
    except UsageError as exc:
        usage = f"usage: {cmd.usage}"
        render.print_note(chat.console, f"{exc} ({usage})" if str(exc) else usage)
        return False


def _update(chat: ChatView, **fields: Any) -> dict[str, Any]:
    session: dict[str, Any] = chat.request(protocol.SESSION_UPDATE, session=chat.session_id, **fields)["session"]
    chat.session = session
    return session


def _target(chat: ChatView, key: str) -> dict[str, Any]:
    """The session a /switch or /delete argument names."""
    found = listing.find(chat.listed or chat.list_sessions(), key)
    if isinstance(found, str):
        raise UsageError(found)
    return dict(found)


# -- the commands ------------------------------------------------------------------

INPUT_HELP = """\
Enter sends. A paste is one message, newlines kept. Alt-Enter starts a new
line; so does Enter after a line ending in \\, and inside a block that a line
of three double quotes (\"\"\") opens and the next such line ends. Ctrl-O (or
/editor) writes the message in $VISUAL/$EDITOR. Tab completes /commands.
Ctrl-C stops an answer (kept as far as it got) or drops what is typed; Ctrl-D
quits. //text sends a message that starts with "/". Up recalls earlier
messages, also from earlier runs."""


@command("/help", "/help", "this list")
def _help(chat: ChatView, args: str) -> None:
    unique = list({id(c): c for c in COMMANDS.values()}.values())  # /exit and /bye are /quit
    table = Table(box=None, show_header=False, padding=(0, 2, 0, 0), pad_edge=False)
    table.add_column(no_wrap=True, width=max(len(c.usage) for c in unique))
    table.add_column()
    for cmd in unique:
        table.add_row(Text(cmd.usage), Text(cmd.help))  # Text: "[path]" is not markup
    chat.console.print(table)
    chat.console.print(Text(INPUT_HELP, style=render.DIM))


@command("/sessions", "/sessions [all]", "list sessions (numbers are what /switch and /delete take); "
         "all: one-shots too, and each branch of an API conversation on its own row")
def _sessions(chat: ChatView, args: str) -> None:
    if args not in ("", "all"):
        raise UsageError("/sessions lists your chats and API conversations, /sessions all every session")
    sessions = chat.list_sessions(everything=args == "all")
    current = chat.session.get("id")
    chat.console.print(listing.sessions_table(sessions, width=chat.console.width, current=current), soft_wrap=True)
    if len(sessions) > listing.SHOWN:
        render.print_note(chat.console, f"… and {len(sessions) - listing.SHOWN} older; /switch ID opens one")
    if chat.hidden_one_shots:
        n = chat.hidden_one_shots
        render.print_note(chat.console, f"({n} one-shot{'' if n == 1 else 's'} not listed: /sessions all lists them)")


@command("/new", "/new [title]", "start a new session")
def _new(chat: ChatView, args: str) -> None:
    chat.create(title=args or None)


@command("/switch", "/switch N|id", "open another session")
def _switch(chat: ChatView, args: str) -> None:
    if not args:
        raise UsageError("say which session: a number from /sessions, or an id")
    target = _target(chat, args)
    if target["id"] == chat.session.get("id"):
        render.print_note(chat.console, "that is the session you are in")
        return
    chat.switch(str(target["id"]))


@command("/rename", "/rename title", "rename this session")
def _rename(chat: ChatView, args: str) -> None:
    if not args:
        raise UsageError("give the new title")
    # An API conversation opened from its row is renamed whole: the row, and each branch under --all, say it.
    others = [sid for sid in chat.group if sid != chat.session_id]
    for sid in others:
        chat.request(protocol.SESSION_UPDATE, session=sid, title=args)
    session = _update(chat, title=args)
    also = f" (and its {len(others)} other branch{'' if len(others) == 1 else 'es'})" if others else ""
    render.print_note(chat.console, f"renamed to {session['title']!r}{also}")


@command("/delete", "/delete [N|id|2 5 7-9|empty]",
         "delete sessions (this one if none is named; numbers, ranges, or the empty ones), after asking")
def _delete(chat: ChatView, args: str) -> None:
    if args:
        found = listing.find_many(chat.listed or chat.list_sessions(), args)
        if isinstance(found, str):
            raise UsageError(found)
        targets = [dict(t) for t in found]
    else:  # this session: opened from a row standing for an API conversation's branches, all of them
        targets = [{**chat.session, "members": chat.group}]
    titles = [render.sanitize(str(t.get("title") or t["id"])) for t in targets]
    # A row that stands for an API conversation's branches deletes them all: the row goes.
    ids = [i for t in targets for i in (t.get("members") or [t["id"]])]
    if len(targets) == 1 and len(ids) > 1:
        question = f"delete {titles[0]!r} and its {len(ids) - 1} branch{'' if len(ids) == 2 else 'es'}? [y/N] "
    elif len(targets) == 1:
        question = f"delete {titles[0]!r}? [y/N] "
    else:
        shown = ", ".join(repr(t) for t in titles[:3]) + (", …" if len(titles) > 3 else "")
        question = f"delete {len(targets)} sessions ({shown})? [y/N] "
    if not _yes(chat, question):
        render.print_note(chat.console, "kept")
        return
    current = chat.session.get("id")
    for session_id in ids:
        chat.request(protocol.SESSION_DELETE, session=session_id)
    chat.listed = []  # their numbers have moved
    what = f"{titles[0]!r}" if len(targets) == 1 else f"{len(targets)} sessions"
    if current in ids:
        chat.forget_current()
        render.print_note(chat.console, f"deleted {what}; here is a new chat")
        chat.console.print()
        chat.create()
    else:
        render.print_note(chat.console, f"deleted {what}")


@command("/export", "/export [path]", "write this session to a Markdown file")
def _export(chat: ChatView, args: str) -> None:
    got = chat.request(protocol.SESSION_GET, session=chat.session_id)
    path = Path(args).expanduser() if args else export.default_path(got["session"])
    if path.is_dir():
        path = path / export.default_path(got["session"])
    if path.exists() and not args and not _yes(chat, f"{path} exists; overwrite it? [y/N] "):
        render.print_note(chat.console, "not exported; /export PATH writes elsewhere")
        return
    messages = got.get("messages") or []
    try:
        export.write_atomic(path, export.to_markdown(got["session"], messages))
    except OSError as exc:
        render.print_error(chat.console, f"cannot write {path}: {exc.strerror or exc}")
        return
    count = len(messages)
    render.print_note(chat.console, f"exported {count} message{'' if count == 1 else 's'} to {path}")


def _yes(chat: ChatView, question: str) -> bool:
    try:
        return chat.input.ask(question).strip().lower() in ("y", "yes")
    except EOFError:
        return False


@command("/system", "/system [text | -]", "show the system prompt, set it, or clear it with -")
def _system(chat: ChatView, args: str) -> None:
    if not args:
        current = chat.session.get("system")
        if current:
            render.print_note(chat.console, f"system: {current}")
        else:
            render.print_note(chat.console, "no system prompt; /system TEXT sets one")
        return
    if args == "-":
        _update(chat, system=None)
        render.print_note(chat.console, "system prompt cleared; from the next answer on")
    else:
        _update(chat, system=args)
        render.print_note(chat.console, "system prompt set; it applies from the next answer on")


@command("/model", "/model [name]", "show this session's model, or answer from NAME from the next message on "
         "(`kvd models` lists them; the first use of a model loads it)")
def _model(chat: ChatView, args: str) -> None:
    current = chat.options.model or chat.session.get("model") or chat.link.client.hello.get("model")
    if not args:
        render.print_note(chat.console, f"model: {render.sanitize(str(current))}; /model NAME answers from another")
        return
    name = args.strip()
    chat.options = dataclasses.replace(chat.options, model=name)
    render.print_note(chat.console, f"the next answer comes from {render.sanitize(name)} "
                      f"({'loaded' if _loaded(chat, name) else 'kvd loads it on first use'})")


def _loaded(chat: ChatView, name: str) -> bool:
    """Whether kvd has a model of that name loaded (`status`'s models: by its name, its name without a
    `builtin:` prefix or a path, or `kvd` for the default)."""
    try:
        models = chat.request(protocol.STATUS).get("models") or []
    except Exception:  # an older daemon, a lost connection: say what is usual
        return False
    for m in models:
        full = str(m.get("model"))
        if name in (full, full.removeprefix("builtin:"), Path(full).name) or (name == "kvd" and m.get("default")):
            return True
    return False


def _param_value(key: str, raw: str) -> float | int | None:
    if raw in ("", "-", "default"):
        return None
    try:
        return int(raw) if key == "max_tokens" else float(raw)
    except ValueError:
        kind = "a whole number" if key == "max_tokens" else "a number"
        raise UsageError(f"{key} must be {kind}, not {raw!r}") from None


@command("/params", "/params [key=value…]",
         "show or set this session's temperature, top_p, max_tokens (key=- goes back to kvd's default)")
def _params(chat: ChatView, args: str) -> None:
    if not args:
        params = chat.session.get("params") or {}
        shown = render.format_params(params) if params else "none set"
        render.print_note(chat.console, f"session params: {shown}")
        render.print_note(chat.console, "in effect: " + in_effect(chat))
        return
    change: dict[str, float | int | None] = {}
    for word in args.split():
        key, eq, raw = word.partition("=")
        if not eq or key not in protocol.PARAMS:
            raise UsageError(f"{word!r} is not key=value with a key of {', '.join(protocol.PARAMS)}")
        change[key] = _param_value(key, raw)
    session = _update(chat, params=change)
    params = session.get("params") or {}
    render.print_note(chat.console, "session params: " + (render.format_params(params) if params else "none set"))


def in_effect(chat: ChatView) -> str:
    """Each param's value for the next answer and where it comes from: this run's flag, the
    session's params, or kvd's default (from hello; a daemon too old to say is "kvd's default")."""
    flags = chat.options.fields()
    session = chat.session.get("params") or {}
    defaults = chat.link.client.hello.get("defaults") or {}
    parts = []
    for key in protocol.PARAMS:
        if key in flags:
            value, source = flags[key], "--" + key.replace("_", "-")
        elif key in session:
            value, source = session[key], "session"
        elif key in defaults:
            value, source = defaults[key], "kvd's default"
        else:
            parts.append(f"{key}=kvd's default")
            continue
        parts.append(f"{key}={render.sanitize(str(value))} ({source})")
    return ", ".join(parts)


# ollama's names for /set parameter, where they differ from kvd's
OLLAMA_PARAMS = {"num_predict": "max_tokens"}


@command("/set", "/set system|parameter …",
         "ollama's spelling: /set system TEXT, /set parameter temperature 0.2 (num_predict is max_tokens)")
def _set(chat: ChatView, args: str) -> None:
    what, _, rest = args.partition(" ")
    rest = rest.strip()
    if what == "system" and rest:
        _system(chat, rest)
        return
    if what == "parameter":
        key, _, value = rest.partition(" ")
        key = OLLAMA_PARAMS.get(key, key)
        if key in protocol.PARAMS and value.strip():
            _params(chat, f"{key}={value.strip()}")
            return
        raise UsageError(f"parameters are {', '.join(protocol.PARAMS)} (num_predict is max_tokens)")
    raise UsageError("kvchat knows /set system and /set parameter")


@command("/regen", "/regen", "write the last answer again")
def _regen(chat: ChatView, args: str) -> None:
    render.print_note(chat.console, "(a new answer to your last message)")
    chat.turn(protocol.CHAT_REGENERATE)


@command("/edit", "/edit [N]", "change your Nth message (/edit alone lists them) and answer it again")
def _edit(chat: ChatView, args: str) -> None:
    messages = chat.request(protocol.SESSION_GET, session=chat.session_id).get("messages") or []
    yours = [m for m in messages if m.get("role") == "user"]
    if not yours:
        render.print_note(chat.console, "no message of yours to edit yet")
        return
    if not args:
        for n, m in enumerate(yours, 1):
            chat.console.print(Text(f"{n:>3}  {listing.one_line(m.get('content'))}"), soft_wrap=True)
        try:
            args = chat.input.ask("edit which? (number, Enter for the last) ").strip() or str(len(yours))
        except EOFError:
            return
    if not args.isdigit() or not 1 <= int(args) <= len(yours):
        raise UsageError(f"N counts your messages, 1 to {len(yours)}")
    n = int(args)
    old = yours[n - 1]
    content = str(old.get("content", ""))
    render.print_note(chat.console, f"editing your message {n}; what came after it is replaced by the new answer")
    if "\n" in content and chat.input.terminal is None:  # line by line it cannot be typed in for you
        render.print_note(chat.console, "it was:\n" + content)
    label = render.prompt(chat.console, "edit> ", render.YOU_STYLE)
    text = chat.input.message(label, chat.continuation, prefill=content, draft=content)
    if not text.strip():
        render.print_note(chat.console, "left as it was")
        return
    # A chat titled after its first message (repl.name_after) is titled after that message as edited.
    retitle = n == 1 and chat.session.get("title") == listing.one_line(content, listing.TITLE_CHARS)
    chat.turn(protocol.CHAT_EDIT, message_index=old["index"], text=text.strip("\n"))
    if retitle and (title := listing.one_line(text, listing.TITLE_CHARS)):
        chat.session = chat.request(protocol.SESSION_UPDATE, session=chat.session_id, title=title)["session"]


@command("/history", "/history", "show every message of this session, whole")
def _history(chat: ChatView, args: str) -> None:
    messages = chat.request(protocol.SESSION_GET, session=chat.session_id).get("messages") or []
    if not messages:
        render.print_note(chat.console, "no messages yet")
        return
    render.print_history(chat.console, messages)


@command("/attach", "/attach", "show the answer this session is writing (e.g. asked for in another window)")
def _attach(chat: ChatView, args: str) -> None:
    chat.turn(protocol.CHAT_ATTACH)


@command("/editor", "/editor [text]", "write the message in $VISUAL/$EDITOR (Ctrl-O at the prompt too), then send it")
def _editor(chat: ChatView, args: str) -> None:
    text = chat.input.compose(args)
    if text.strip():
        chat.send(text)


@command("/copy", "/copy [code]", "put the last answer (or its last code block) on the clipboard")
def _copy(chat: ChatView, args: str) -> None:
    if args not in ("", "code"):
        raise UsageError("/copy copies the last answer, /copy code its last code block")
    messages = chat.request(protocol.SESSION_GET, session=chat.session_id).get("messages") or []
    answer = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    if answer is None:
        render.print_note(chat.console, "no answer to copy yet")
        return
    text = clipboard.sanitize_for_copy(str(answer.get("content", "")))
    what = "the last answer"
    if args == "code":
        blocks = clipboard.code_blocks(text)
        if not blocks:
            render.print_note(chat.console, "the last answer has no code block; /copy copies all of it")
            return
        text, what = blocks[-1], "its last code block"
    render.print_note(chat.console, clipboard.copy(chat.console, text, chat.copy_file, what=what))


@command("/compact", "/compact", "go on in a new session that carries the system prompt and the last "
         "turns fitting in half the context (and a long paste they refer to); says what first, and asks")
def _compact(chat: ChatView, args: str) -> None:
    compact.run(chat)


@command("/clear", "/clear", "clear the screen (the session stays; /new starts another)")
def _clear(chat: ChatView, args: str) -> None:
    chat.console.clear()
    render.print_header(chat.console, chat.session, chat.link.client.hello)


@command("/quit", "/quit, /exit, /bye", "leave (Ctrl-D at an empty prompt too)")
def _quit(chat: ChatView, args: str) -> bool:
    return True


COMMANDS["/exit"] = COMMANDS["/quit"]
COMMANDS["/bye"] = COMMANDS["/quit"]
