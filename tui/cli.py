"""``kvchat``: talk to a running kvd from the terminal.

Startup only: parse flags, find and connect to the daemon, open or resume a
session, then hand over to the chat loop (repl.py). kvchat knows the wire
protocol (daemon.protocol) and nothing else of kvd: importing it must never
load mlx, numpy or the stores.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from daemon import protocol

from . import render
from .client import Client
from .discover import locate
from .errors import KvchatError, ServerError
from .lineinput import enable_line_editing
from .loop_thread import LoopThread
from .repl import Chat, ChatOptions, Interrupts

try:
    import termios
except ImportError:  # not a POSIX terminal
    termios = None  # type: ignore[assignment]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvchat", description="Chat with a running kvd daemon.")
    where = parser.add_argument_group("daemon")
    where.add_argument("--url", help=f"websocket URL (default: from <data-dir>/daemon.json, else {protocol.default_url()})")
    where.add_argument("--data-dir", type=Path, help="kvd's data directory (default: $KVD_DATA_DIR or ~/.local/share/kvd)")
    where.add_argument("--token-file", type=Path, help="token file (default: <data-dir>/token)")
    which = parser.add_argument_group("session").add_mutually_exclusive_group()
    which.add_argument("--session", metavar="ID", help="resume the session with this id")
    which.add_argument("--last", action="store_true", help="resume the most recently used session")
    new = parser.add_argument_group("new session")
    new.add_argument("--title", help="title of the new session")
    new.add_argument("--system", help="system prompt of the new session")
    gen = parser.add_argument_group("generation")
    gen.add_argument("--max-tokens", type=_positive_int, metavar="N", help="longest answer, in tokens")
    gen.add_argument("--temperature", type=_temperature, metavar="T", help="0 (greedy) to 2")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(highlight=False)
    errors = Console(stderr=True, highlight=False)
    interrupts = Interrupts()
    try:
        with interrupts.installed(), _terminal_restored(), LoopThread() as net:
            try:
                endpoint = locate(url=args.url, data_dir=args.data_dir, token_file=args.token_file)
                client = net.run(Client.connect(endpoint.url, endpoint.token, token_path=endpoint.token_path))
            except KvchatError as exc:
                render.print_error(errors, str(exc))
                return 1
            try:
                session, messages = net.run(_open_session(client, args, console))
            except KvchatError as exc:
                render.print_error(errors, _session_error(exc, args))
                return 1
            try:
                render.print_header(console, session, client.hello, resumed=bool(messages) or args.session is not None)
                render.print_history(console, messages)
                enable_line_editing()
                options = ChatOptions(max_tokens=args.max_tokens, temperature=args.temperature)
                return Chat(console, net, client, str(session["id"]), options, interrupts).run()
            finally:
                with contextlib.suppress(Exception, KeyboardInterrupt):
                    net.run(client.close())
    except KeyboardInterrupt:
        errors.print()
        return 130


async def _open_session(
    client: Client, args: argparse.Namespace, console: Console
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The session to chat in and the messages it already has."""
    session_id = args.session
    if args.last:
        sessions = (await client.request(protocol.SESSION_LIST)).get("sessions") or []
        if sessions:
            session_id = sessions[0]["id"]
        else:
            render.print_note(console, "no earlier session; starting a new one")
    if session_id is not None:
        if args.title or args.system:
            render.print_note(console, "--title and --system apply to new sessions; ignored")
        if not protocol.SESSION_ID_RE.match(session_id):
            raise KvchatError(f"{session_id!r} is not a session id (16 hex characters, shown when a chat starts)")
        reply = await client.request(protocol.SESSION_GET, session=session_id)
        return reply["session"], list(reply.get("messages") or [])
    fields = {k: v for k, v in (("title", args.title), ("system", args.system)) if v is not None}
    reply = await client.request(protocol.SESSION_CREATE, **fields)
    return reply["session"], []


def _session_error(exc: KvchatError, args: argparse.Namespace) -> str:
    if isinstance(exc, ServerError) and exc.code == protocol.UNKNOWN_SESSION:
        return f"no session {args.session}; `kvchat --last` resumes the most recent one, `kvchat` starts a new one"
    return str(exc)


@contextlib.contextmanager
def _terminal_restored() -> Iterator[None]:
    """Whatever happens (Ctrl-C mid-answer included), leave the terminal as found."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else -1
    saved = None
    if termios is not None and fd >= 0:
        with contextlib.suppress(termios.error):
            saved = termios.tcgetattr(fd)
    try:
        yield
    finally:
        if saved is not None:
            with contextlib.suppress(termios.error):
                termios.tcsetattr(fd, termios.TCSANOW, saved)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 2:
        raise argparse.ArgumentTypeError("must be between 0 and 2")
    return value


if __name__ == "__main__":
    sys.exit(main())
