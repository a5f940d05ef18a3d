"""Everything kvchat shows, drawn on a given Rich console.

No I/O of its own beyond the console, so tests render on a capture console of
fixed width. Text from the wire (answers, titles, error messages) is
untrusted: it goes through :func:`sanitize` and is printed as ``Text`` or
Markdown, never as Rich markup, so a model can neither drive the terminal nor
style itself. Answers stream through :class:`tui.answer.AnswerPrinter`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

import protocol

from .answer import AnswerPrinter, Labelled, render_answer
from .sanitize import StreamSanitizer, sanitize

__all__ = ["AnswerPrinter", "StreamSanitizer", "sanitize"]

YOU = "you> "
KVD = "kvd> "
CONTINUE = "...> "
YOU_STYLE = "bold green"
KVD_STYLE = "bold cyan"
DIM = "dim"
ERROR_STYLE = "bold red"
SYSTEM_SHOWN = 200  # characters of a long system prompt in a session's header


def answer_printer(console: Console) -> AnswerPrinter:
    return AnswerPrinter(console, KVD, KVD_STYLE)


def calls_text(calls: object) -> list[str]:
    """An answer's tool calls (an API client's), one line each: ``called get_weather({"city": "Paris"})``."""
    if not isinstance(calls, list):
        return []
    return [f"called {sanitize(str(c.get('name')))}({sanitize(str(c.get('arguments')))})"
            for c in calls if isinstance(c, Mapping)]


def print_message(console: Console, role: str, content: str, status: str = "complete",
                  calls: object = None, finish_reason: object = None) -> None:
    """One message of a transcript: the user's as typed, an answer as Markdown (and the tools it called),
    a tool's result (an API client's) dim."""
    if role == "tool":
        console.print(Text(f"tool result: {sanitize(content)}", style=DIM), soft_wrap=True)
    elif role == "user":
        label = Text(YOU, style=YOU_STYLE)
        width = max(console.width - label.cell_len, 10)
        lines = console.render_lines(Text(sanitize(content)), console.options.update(width=width), pad=False)
        console.print(Labelled(lines or [[]], label, label.cell_len), soft_wrap=True)
    else:
        if content or not calls:
            console.print(render_answer(sanitize(content), Text(KVD, style=KVD_STYLE)), soft_wrap=True)
        else:
            console.print(Text(KVD, style=KVD_STYLE), end="")
        for line in calls_text(calls):
            console.print(Text(line, style=DIM), soft_wrap=True)
    if status == "streaming":
        console.print(Text("(still being written: /attach follows it)", style=DIM), soft_wrap=True)
    elif status == "error" and finish_reason == "interrupted":  # kvd died mid-answer (docs/protocol.md)
        console.print(Text("(cut off: kvd stopped while writing it)", style=DIM), soft_wrap=True)
    elif status != "complete":
        console.print(Text(f"({sanitize(status)})", style=DIM), soft_wrap=True)


RECENT_TURNS = 2  # exchanges a resumed session shows (/history shows all)
CLIP_LINES = 12  # a shown message longer than this (a paste) is cut to its first CLIP_KEPT lines
CLIP_KEPT = 6
CLIP_CHARS = 2000


def clipped(content: str) -> tuple[str, int]:
    """A message's first lines, and how many lines were left out (0: all of it)."""
    lines = content.split("\n")
    if len(lines) <= CLIP_LINES and len(content) <= CLIP_CHARS:
        return content, 0
    kept = "\n".join(lines[:CLIP_KEPT])[:CLIP_CHARS // 2]
    return kept, len(lines) - kept.count("\n") - 1


def print_history(console: Console, messages: Sequence[Mapping[str, Any]], *, recent: int | None = None) -> None:
    """A session's transcript, a blank line after each answer as in a live chat.

    With `recent`, only the last `recent` exchanges (from the user message that starts each), each long
    message of the user's (a paste) cut to its first lines: resuming a session with a 200-line paste
    replayed all of it.
    """
    start = 0
    if recent is not None:
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        start = users[-recent] if len(users) >= recent else 0
        if start:
            print_note(console, f"({start} earlier message{'' if start == 1 else 's'} not shown; "
                                "/history shows them all)")
    for message in messages[start:]:
        role = str(message.get("role", ""))
        content, cut = str(message.get("content", "")), 0
        if recent is not None and role == "user":  # a paste; answers are what a resumed chat is reread for
            content, cut = clipped(content)
        print_message(console, role, content, str(message.get("status", "complete")), message.get("tool_calls"),
                      message.get("finish_reason"))
        if cut:
            print_note(console, f"… ({cut} more line{'' if cut == 1 else 's'}; /history shows them all)")
        if role == "assistant":
            console.print()


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _short(model: Any) -> str:
    """A model's name as the status line says it: smollm2 for builtin:smollm2."""
    return sanitize(str(model).removeprefix("builtin:"))


def cache_part(usage: Mapping[str, Any]) -> str | None:
    """``cache: disk 4096 tok in 86 ms``, ``cache: resident 94 tok at a checkpoint in 0.4 ms``, or ``cache: none,
    prefilled 40 tok``."""
    tier = usage.get("restored_from")
    if tier in protocol.TIERS or tier == protocol.SHARED:  # shared: another conversation's prefix
        restored, ms = usage.get("restored_tokens"), usage.get("restore_ms")
        part = f"cache: {tier}" + (" (prefetched from disk)" if usage.get("prefetched") else "")
        if isinstance(restored, int):
            part += f" {restored} tok"
        if usage.get("checkpoint") is True:  # a model with recurrent or window layers, rewound to kept state
            part += " at a checkpoint"
        if isinstance(ms, (int, float)):
            part += f" in {_ms(ms)} ms"
        return part
    if tier == protocol.NO_CACHE:
        prefilled, ms = usage.get("prefill_tokens"), usage.get("prefill_ms")
        took = f" in {duration(ms)}" if isinstance(ms, (int, float)) and ms >= READ_SHOWN_MS else ""
        kept, model = usage.get("kept_for"), usage.get("model")
        elsewhere = (f" for {_short(model)} (kept for {', '.join(_short(k) for k in kept)})"
                     if isinstance(kept, list) and kept and isinstance(model, str) else "")
        return f"cache: none{elsewhere}" + (f", prefilled {prefilled} tok{took}" if isinstance(prefilled, int) else "")
    cached = usage.get("cached_tokens")  # a daemon from before cache tiers
    return f"{cached} cached" if isinstance(cached, int) else None


# A restored cache's status line also says what was read on top of it when that was a real cost: a paste
# of 4,946 tokens took 98 s on a CPU, and the line said only `cache: resident 201 tok in 0.6 ms`.
READ_SHOWN_TOKENS = 256
READ_SHOWN_MS = 1000.0


def duration(ms: float) -> str:
    """`450 ms`, `3.1 s`, `98 s`."""
    if ms < 1000:
        return f"{_ms(ms)} ms"
    return f"{ms / 1000:.1f} s" if ms < 10_000 else f"{ms / 1000:.0f} s"


def read_part(usage: Mapping[str, Any]) -> str | None:
    """``read 4745 tok in 98 s``: the prompt read on top of a restored cache, when it was large or slow, or when
    the cache was restored at a checkpoint (what a rewind computed again)."""
    tokens, ms = usage.get("prefill_tokens"), usage.get("prefill_ms")
    if usage.get("restored_from") in (None, protocol.NO_CACHE) or not isinstance(tokens, int) or tokens <= 0:
        return None
    slow = isinstance(ms, (int, float)) and ms >= READ_SHOWN_MS
    if tokens < READ_SHOWN_TOKENS and not slow and usage.get("checkpoint") is not True:
        return None
    return f"read {tokens} tok" + (f" in {duration(ms)}" if isinstance(ms, (int, float)) else "")


def context_part(usage: Mapping[str, Any]) -> str | None:
    """``8142/8192 ctx``: how much of the model's context the session fills after this answer."""
    used, window = usage.get("context_tokens"), usage.get("context_window")
    if not isinstance(used, int) or not used:
        return None
    return f"{used}/{window} ctx" if isinstance(window, int) else f"{used} ctx"


def draft_part(usage: Mapping[str, Any]) -> str | None:
    """``draft 41/52 kept``: speculative decoding's guesses and how many the model kept; None if none ran."""
    drafted, accepted = usage.get("drafted_tokens"), usage.get("accepted_tokens")
    if not isinstance(drafted, int) or not isinstance(accepted, int) or drafted <= 0:
        return None
    return f"draft {accepted}/{drafted} kept"


def status_line(usage: Mapping[str, Any], finish_reason: str | None = None) -> str:
    """The parts of :func:`status_parts`, joined with ``·``."""
    return STATUS_JOIN.join(status_parts(usage, finish_reason))


STATUS_JOIN = " · "


def status_parts(usage: Mapping[str, Any], finish_reason: str | None = None) -> list[str]:
    """``12 tokens · TTFT 35 ms · 210.4 tok/s · draft 9/12 kept · cache: disk 28 tok in 3.1 ms · 52/8192 ctx``.

    Parts the daemon left out are omitted; ``read N tok in T`` says what was
    read on top of a restored cache when it was large or slow (a long paste),
    and ``re-read N tok`` when history was fed again (a new system prompt, an
    edit), since the restored count alone would look cheap.
    """
    parts = []
    completion = usage.get("completion_tokens")
    if isinstance(completion, int):
        parts.append(f"{completion} token" + ("" if completion == 1 else "s"))
    ttft = usage.get("ttft_ms")
    if isinstance(ttft, (int, float)):
        parts.append(f"TTFT {ttft:.0f} ms")
    tps = usage.get("decode_tps")
    if isinstance(tps, (int, float)):
        parts.append(f"{tps:.1f} tok/s")
    if (drafts := draft_part(usage)) is not None:
        parts.append(drafts)
    if (cache := cache_part(usage)) is not None:
        parts.append(cache)
    if (read := read_part(usage)) is not None:
        parts.append(read)
    reread = usage.get("reread_tokens")
    if isinstance(reread, int) and reread > 0 and usage.get("restored_from") != protocol.NO_CACHE:
        parts.append(f"re-read {reread} tok")  # a new system prompt or an edit: history fed again
    if (context := context_part(usage)) is not None:
        parts.append(context)
    if finish_reason in ("cancelled", "length"):
        parts[-1:] = [f"{parts[-1]} ({finish_reason})" if parts else f"({finish_reason})"]
    return parts


def packed(parts: list[str], width: int) -> list[str]:
    """`parts` joined with `·` into lines of at most `width` cells, breaking only between parts
    (so `176/8192 ctx` or `cache: disk 4096 tok in 86 ms` is never cut in two); a part wider
    than the line gets a line of its own."""
    lines: list[str] = []
    for part in parts:
        if lines and cell_len(lines[-1] + STATUS_JOIN + part) <= width:
            lines[-1] += STATUS_JOIN + part
        else:
            lines.append(part)
    return lines


def unwrapped(console: Console) -> bool:
    """Rich's soft_wrap for a status, note or error line: on a terminal Rich wraps it at word boundaries
    (the terminal would cut words); into a pipe or file it stays one line, for grep and scripts."""
    return not console.is_terminal


def print_status(console: Console, done: Mapping[str, Any], *, blank: bool = True) -> None:
    """The dim line under an answer, from its ``chat.done`` event (then a blank line)."""
    usage = done.get("usage")
    reason = done.get("finish_reason")
    parts = status_parts(usage if isinstance(usage, Mapping) else {}, reason if isinstance(reason, str) else None)
    if unwrapped(console):
        console.print(Text(STATUS_JOIN.join(parts), style=DIM), soft_wrap=True)
    else:  # broken between its parts, not inside one
        console.print(Text("\n".join(packed(parts, console.width)), style=DIM))
    if blank:
        console.print()


def print_header(
    console: Console,
    session: Mapping[str, Any],
    hello: Mapping[str, Any],
    *,
    resumed: bool = False,
) -> None:
    """Title, then session id, model and server, so the id to resume is on screen."""
    title = sanitize(str(session.get("title") or protocol.DEFAULT_TITLE))
    console.print(Text(title, style="bold"), soft_wrap=True)
    details = [f"session {sanitize(str(session.get('id', '?')))}"]
    model = session.get("model") or hello.get("model")  # the session's own (older daemons: the daemon's)
    if model:
        details.append(f"model {sanitize(str(model))}" + ("" if hello.get("ready", True) else " (loading)"))
    if resumed:
        count = session.get("message_count")
        if isinstance(count, int):
            details.append(f"{count} message" + ("" if count == 1 else "s"))
        if (cache := held_part(session)) is not None:
            details.append(cache)
    server = hello.get("server")
    if server:
        details.append(sanitize(str(server)))
    if unwrapped(console):
        console.print(Text(" · ".join(details), style=DIM), soft_wrap=True)
    else:  # broken between its parts (`4 messages`, `cache: disk 5312 tok` stay whole)
        console.print(Text("\n".join(packed(details, console.width)), style=DIM))
    system = session.get("system")
    if system:
        shown = sanitize(str(system))
        if len(shown) > SYSTEM_SHOWN or shown.count("\n") > 2:  # e.g. /compact's: /system shows it all
            shown = " ".join(shown[:SYSTEM_SHOWN].split()) + f" … ({len(shown)} characters; /system shows it all)"
        console.print(Text(f"system: {shown}", style=DIM), soft_wrap=unwrapped(console))
    params = session.get("params")
    if isinstance(params, Mapping) and params:
        console.print(Text("params: " + format_params(params), style=DIM), soft_wrap=unwrapped(console))
    console.print(Text("/help for commands · Ctrl-C stops an answer · Ctrl-D quits", style=DIM),
                  soft_wrap=unwrapped(console))
    console.print()


def held_part(session: Mapping[str, Any]) -> str | None:
    """Where a resumed session's cache is, before its next answer: ``cache: disk 5312 tok``, or
    ``cache: none (the next answer re-reads 5312 tok)``."""
    tier, tokens = session.get("cache"), session.get("tokens")
    if not isinstance(tier, str) or not isinstance(tokens, int) or not tokens:
        return None
    if tier == protocol.NO_CACHE:
        return f"cache: none (the next answer re-reads {tokens} tok)"
    return f"cache: {sanitize(tier)} {tokens} tok"


def format_params(params: Mapping[str, Any]) -> str:
    return " ".join(f"{key}={sanitize(str(value))}" for key, value in params.items())


def print_error(console: Console, message: str) -> None:
    """One red line; the message itself says what to do."""
    console.print(Text(f"error: {sanitize(message)}", style=ERROR_STYLE), soft_wrap=unwrapped(console))


def print_note(console: Console, message: str) -> None:
    console.print(Text(sanitize(message), style=DIM), soft_wrap=unwrapped(console))


def prompt(console: Console, label: str, style: str) -> str:
    """The label as a string for a prompt: with the console's colour escapes, if it has colour."""
    with console.capture() as capture:
        console.print(Text(label, style=style), end="", soft_wrap=True)
    return capture.get()
