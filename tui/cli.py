"""``kvchat``: talk to a running kvd from the terminal.

Startup only: parse flags, find and connect to the daemon, pick a session,
then hand over to the chat loop (repl.py). Given a message (``kvchat "question"``,
``kvchat -`` or stdin that is not a terminal) it answers that one message for a
script instead (oneshot.py). kvchat knows the wire protocol
(the `protocol` package) and nothing else of kvd: importing it must never load mlx,
numpy or the stores.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

import protocol
from common.limits import TEMPERATURE

from . import commands, listing, render
from .chatview import ChatOptions
from .errors import KvchatError
from .history import HISTORY_FILE, History
from .interrupts import Interrupts
from .lineinput import Input, quiet_terminal
from .link import Link
from .loop_thread import LoopThread
from .repl import Chat

if TYPE_CHECKING:
    from .terminal import Terminal

try:
    import termios
except ImportError:  # not a POSIX terminal
    termios = None  # type: ignore[assignment]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvchat", description="Chat with a running kvd daemon. Without --session, --last or --new, "
        "kvchat lists your sessions to pick one. Given a MESSAGE (or `-`, or stdin that is not a terminal), "
        "it prints only the answer and exits: in a new session unless --session or --last says which.")
    parser.add_argument("message", nargs="?", metavar="MESSAGE",
                        help="ask this and print only the answer; `-` reads the message from stdin")
    where = parser.add_argument_group("daemon")
    where.add_argument("--url", help="websocket URL (default: from <data-dir>/daemon.json, "
                       f"else {protocol.default_url()})")
    where.add_argument("--data-dir", type=Path, help="kvd's data directory (default: $KVD_DATA_DIR, "
                       "else $XDG_DATA_HOME/kvd, else ~/.local/share/kvd)")
    where.add_argument("--token-file", type=Path, help="token file (default: <data-dir>/token)")
    which = parser.add_argument_group("session").add_mutually_exclusive_group()
    which.add_argument("--session", metavar="ID", help="resume the session with this id")
    which.add_argument("--last", action="store_true",
                       help="resume the chat you last typed in (not a one-shot; --from any: of any client); "
                            "with MESSAGE, the most recent kvchat session, one-shots included")
    which.add_argument("--new", action="store_true", help="start a new session without the list")
    parser.add_argument("--all", action="store_true", dest="everything",
                        help="list every session: one-shots too, and each branch of an API conversation "
                             "(a retry, an edit) on its own row")
    parser.add_argument("--from", dest="origin", choices=listing.ORIGINS, metavar="ORIGIN",
                        help="only sessions made by: kvchat (its one-shots too), one-shot, api (OpenAI clients), "
                             "ws (other websocket clients) or any (default: any for the list, your chats for --last)")
    new = parser.add_argument_group("new session")
    new.add_argument("--title", help="title of the new session")
    new.add_argument("--system", help="system prompt of the new session")
    parser.add_argument("--model", help="the model to answer (`kvd models` lists them; default: the daemon's): "
                        "new sessions are made with it, a resumed one switches to it (/model does so later)")
    gen = parser.add_argument_group("generation (for this run; /params sets a session's own)")
    gen.add_argument("--max-tokens", type=_positive_int, metavar="N", help="longest answer, in tokens")
    gen.add_argument("--temperature", type=_temperature, metavar="T", help=f"0 (greedy) to {TEMPERATURE.high:g}")
    parser.add_argument("--version", action="version", version=f"kvchat {_version()}")
    script = parser.add_argument_group("scripts (with MESSAGE or -)")
    script.add_argument("--json", action="store_true",
                        help="print one JSON object: answer, finish_reason, usage, session")
    script.add_argument("--strict", action="store_true",
                        help="exit 3 when the answer stopped at max_tokens (it is still printed)")
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvd")
    except PackageNotFoundError:
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.message is None and sys.stdin is not None and not sys.stdin.isatty():
        args.message = "-"  # `cmd | kvchat`: the whole of stdin is one message
    if args.message is None:
        if args.json:
            parser.error("--json needs a MESSAGE (or -, or piped input)")
        return run(args, Console(highlight=False), Console(stderr=True, highlight=False))
    from .oneshot import answer_one

    return answer_one(args, sys.stdin, sys.stdout, Console(stderr=True, highlight=False))


def run(
    args: argparse.Namespace,
    console: Console,
    errors: Console,
    *,
    read_line: Callable[[str], str] = input,
    echo: bool | None = None,
    signals: bool = True,
) -> int:
    """kvchat with these flags, on these consoles; tests pass their own input and no signal handling."""
    interrupts = Interrupts()
    data_dir = args.data_dir if args.data_dir is not None else protocol.default_data_dir()
    history = History(data_dir / HISTORY_FILE)
    installed = interrupts.installed() if signals else contextlib.nullcontext()
    try:
        with installed, _terminal_restored(), quiet_terminal(), LoopThread() as net:
            link = Link(url=args.url, data_dir=args.data_dir, token_file=args.token_file)
            try:
                net.run(link.connect())
            except KvchatError as exc:
                render.print_error(errors, str(exc))
                return 1
            try:
                history.read()
                typed = Input(console, read_line=read_line, history=history,
                              echo=not sys.stdin.isatty() if echo is None else echo,
                              terminal=_terminal(history) if read_line is input else None)
                chat = Chat(console, net, link, interrupts, typed,
                            ChatOptions(max_tokens=args.max_tokens, temperature=args.temperature,
                                        model=args.model))
                try:
                    # A title or system prompt asks for a new session: no list to pick from.
                    new = args.new or (not args.session and not args.last and (args.title or args.system))
                    if not chat.open(session_id=args.session, last=args.last, new=bool(new), origin=args.origin,
                                     title=args.title, system=args.system, everything=args.everything):
                        return 0
                except KvchatError as exc:
                    render.print_error(errors, str(exc))
                    return 1
                if (args.title or args.system) and (args.session or args.last):
                    render.print_note(console, "--title and --system apply to new sessions; ignored")
                return chat.run()
            finally:
                history.save()
                with contextlib.suppress(Exception, KeyboardInterrupt):
                    net.run(link.close())
    except KeyboardInterrupt:
        errors.print()
        return 130


def _terminal(history: History) -> Terminal | None:
    """The line editor, when a person is at a terminal (input and output both)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return None
    from .terminal import Terminal

    return Terminal(sorted(commands.COMMANDS), history)


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
    if value not in TEMPERATURE:
        raise argparse.ArgumentTypeError(f"must be in {TEMPERATURE.describe()}")
    return value


if __name__ == "__main__":
    sys.exit(main())
