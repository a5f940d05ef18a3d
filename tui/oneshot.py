"""``kvchat "question"`` and ``cmd | kvchat -``: one message in, only its answer out.

For scripts: stdout gets the answer and nothing else (no banner, prompt or
status line), streamed as it comes, or with --json one object at the end;
everything else goes to stderr, and a failure exits non-zero:

- 0  the answer was printed (also when it stopped at max_tokens, which stderr says; see finish_reason)
- 1  kvd refused or failed (not running, unknown session, the conversation does not fit, …)
- 2  the flags or the input cannot be used (argparse's code)
- 3  with --strict: the answer stopped at max_tokens (it is printed, cut where it stopped)
- 130  interrupted by Ctrl-C (the answer is cancelled and kept as far as it got)

An answer cut by max_tokens exits 0 by default: a script that asked for a
short answer got what it asked for, and a pipeline should not fail because
a model is wordy. `--strict` is for scripts that need the whole answer.

Without --session or --last the message starts a new session, titled after
it and kept like any other (`kvchat --last "and then?"` continues it; the
interactive `kvchat --last` opens the last chat typed in, not a one-shot).

Piped text and a question travel together: ``git diff | kvchat "Review
this."`` sends the piped text, a blank line, then the question, the order
`llm` uses (it joins them with a space; the blank line keeps the question off
the file's last line). The session is titled after the question.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from collections.abc import Callable
from typing import Any, TextIO

from rich.console import Console

import protocol

from . import listing, render
from .client import Client
from .errors import ConnectionLost, GaveUp, KvchatError, ServerError
from .link import Link
from .listing import ONE_SHOT
from .sanitize import StreamSanitizer

# Errors that refuse a chat.send before anything is generated (max_tokens past the limit, a message
# longer than the model's context): a session this call made for it is deleted again.
REFUSALS = frozenset({protocol.BAD_REQUEST, protocol.TOO_LARGE})


class UsageProblem(Exception):
    """The flags or the input cannot be used (exit 2)."""


CUT = 3  # --strict: the answer stopped at max_tokens

# What the daemon refuses as unusable input exits 2, like kvchat's own checks of the flags: whether a
# value is out of range is for the daemon to say (its limits are its config), not for the exit code.
UNUSABLE = frozenset({"bad_request"})


def answer_one(args: argparse.Namespace, stdin: TextIO, stdout: TextIO, errors: Console) -> int:
    try:
        return asyncio.run(_answer(args, lambda: _message(args, stdin), stdout, errors))
    except UsageProblem as exc:
        return _failed(args, stdout, errors, str(exc), "usage", 2)
    except ServerError as exc:
        return _failed(args, stdout, errors, _explained(exc), exc.code, 2 if exc.code in UNUSABLE else 1)
    except KvchatError as exc:
        return _failed(args, stdout, errors, _explained(exc), "kvchat", 1)
    except KeyboardInterrupt:
        return 130


def _failed(args: argparse.Namespace, stdout: TextIO, errors: Console, message: str, code: str, status: int) -> int:
    """One line on stderr; with --json also one JSON object on stdout, so a script reads the failure too."""
    render.print_error(errors, message)
    if args.json:
        stdout.write(json.dumps({"error": {"message": message, "code": code}, "exit_status": status}) + "\n")
        stdout.flush()
    return status


def _message(args: argparse.Namespace, stdin: TextIO) -> str:
    if (args.system or args.title) and (args.session or args.last):
        raise UsageProblem("--system and --title set up a new session; with --session or --last, "
                           "change the session's system prompt in kvchat with /system")
    if args.message == "-":
        text = _read(stdin)
    else:
        text = args.message.strip("\n")
        # `cmd | kvchat "question"`: the piped text, then the question (llm's order), a blank line between.
        piped = _read(stdin) if stdin is not None and not stdin.isatty() else ""
        if piped.strip() and text.strip():
            text = f"{piped}\n\n{text}"
        elif piped.strip():
            text = piped
    if not text.strip():
        empty = " (stdin was empty)" if args.message == "-" else ""
        raise UsageProblem(f"nothing to send: the message is empty{empty}")
    return text


def _read(stdin: TextIO) -> str:
    """All of stdin, its leading and trailing newlines dropped."""
    try:
        return stdin.read().strip("\n")
    except UnicodeDecodeError as exc:
        raise UsageProblem(f"stdin is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def _explained(exc: KvchatError) -> str:
    if isinstance(exc, ServerError) and exc.code == protocol.UNKNOWN_SESSION:
        return "no such session; `kvchat` lists them, `--last` continues the most recent"
    return str(exc)


async def _answer(args: argparse.Namespace, message: Callable[[], str], stdout: TextIO, errors: Console) -> int:
    link = Link(url=args.url, data_dir=args.data_dir, token_file=args.token_file)
    client = await link.connect()  # first: "kvd is not running" matters more than an empty stdin
    try:
        text = message()
        session, created = await _session(client, args, text)
        await client.wait_ready()
        fields: dict[str, Any] = {"text": text}
        if args.max_tokens is not None:
            fields["max_tokens"] = args.max_tokens
        if args.temperature is not None:
            fields["temperature"] = args.temperature
        if args.model is not None:
            fields["model"] = args.model
        interrupted = asyncio.Event()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGINT, interrupted.set)
        canceller = asyncio.create_task(_cancel_when(interrupted, client, session))
        try:
            done = await _stream(client, session, fields, stdout, printing=not args.json)
        except GaveUp:
            raise
        except ConnectionLost as e:  # the client knows the URL; this daemon's data dir is ours to name
            raise ConnectionLost(e.url, e.why, args.data_dir) from e
        except ServerError as e:
            if created and e.code in REFUSALS:  # refused before anything was generated: leave nothing behind
                with contextlib.suppress(KvchatError):
                    await client.request(protocol.SESSION_DELETE, session=session)
            raise
        finally:
            canceller.cancel()
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGINT)
        answer = done.pop("_text")
        if args.json:
            stdout.write(json.dumps({"answer": answer, "finish_reason": done.get("finish_reason"),
                                     "usage": done.get("usage"), "session": session},
                                    ensure_ascii=False) + "\n")
        elif answer and not answer.endswith("\n"):
            stdout.write("\n")
        stdout.flush()
        if interrupted.is_set():
            return 130
        if done.get("finish_reason") == "length":
            tokens = (done.get("usage") or {}).get("completion_tokens")
            render.print_note(errors, f"kvchat: the answer stopped at max_tokens ({tokens} tokens), cut where it "
                              "stopped; --max-tokens N allows a longer one" + ("" if args.strict else
                                                                               " (--strict exits 3 on this)"))
            return CUT if args.strict else 0
        return 0
    finally:
        await client.close()


async def _session(client: Client, args: argparse.Namespace, text: str) -> tuple[str, bool]:
    """The session to send to, and whether this call created it."""
    if args.session:
        if not protocol.SESSION_ID_RE.fullmatch(args.session):
            raise KvchatError(f"{args.session!r} is not a session id (16 hex characters)")
        await client.request(protocol.SESSION_GET, session=args.session)  # unknown_session if it is not there
        return str(args.session), False
    if args.last:
        listed = (await client.request(protocol.SESSION_LIST)).get("sessions") or []
        sessions = listing.made_by(listed, args.origin or "kvchat")
        if sessions:
            return str(sessions[0]["id"]), False
    # Titled after what was typed: the question, not the file piped in before it.
    typed = args.message if args.message not in (None, "-") and args.message.strip() else text
    title = args.title or listing.one_line(typed, listing.TITLE_CHARS) or None
    fields = {k: v for k, v in (("title", title), ("system", args.system), ("model", args.model)) if v}
    return str((await client.request(protocol.SESSION_CREATE, origin=ONE_SHOT, **fields))["session"]["id"]), True


async def _stream(client: Client, session: str, fields: dict[str, Any], stdout: TextIO,
                  *, printing: bool) -> dict[str, Any]:
    """The answer's chat.done, with the whole text under "_text"; deltas printed as they come."""
    sanitizer = StreamSanitizer()
    text = ""
    stream = client.stream(protocol.CHAT_SEND, session=session, **fields)
    async with contextlib.aclosing(stream):
        try:
            async for event in stream:
                if event.get("type") == protocol.CHAT_DELTA:
                    piece = sanitizer.feed(str(event.get("text", "")))
                    text += piece
                    if printing and piece:
                        stdout.write(piece)
                        stdout.flush()
                elif event.get("type") == protocol.CHAT_DONE:
                    rest = sanitizer.flush()
                    text += rest
                    if printing and rest:
                        stdout.write(rest)
                    return {**event, "_text": text}
        except KvchatError:
            if printing and text and not text.endswith("\n"):  # the error (stderr) goes on a line of its own
                stdout.write("\n")
                stdout.flush()
            raise
    raise KvchatError("the answer ended without chat.done")  # the client raises ConnectionLost first


async def _cancel_when(interrupted: asyncio.Event, client: Client, session: str) -> None:
    await interrupted.wait()
    with contextlib.suppress(KvchatError):
        await client.request(protocol.CHAT_CANCEL, session=session)
