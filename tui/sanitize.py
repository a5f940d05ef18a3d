"""Model and server text, minus anything a terminal would act on.

Text from the wire (answers, titles, error messages) is untrusted: a model
could otherwise clear the screen, retitle the window or write the clipboard.
"""

from __future__ import annotations

import re

# Terminal escape sequences: CSI, OSC/DCS/SOS/PM/APC strings, two-character escapes.
_ESCAPE = re.compile(
    r"""
      \x1b\[[0-?]*[ -/]*[@-~]                  # CSI: cursor, colours, clear screen
    | \x1b[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)  # OSC & co: titles, hyperlinks, clipboard
    | \x1b[ -/]*[0-~]                          # ESC c (reset), ESC 7, charset selection
    | \x9b[0-?]*[ -/]*[@-~]                    # the same as C1 controls
    | [\x90\x98\x9d-\x9f][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)
    """,
    re.VERBOSE,
)
# What survives is stripped one character at a time: C0 controls but \t and \n,
# DEL, and the C1 controls (U+0080-U+009F; some terminals act on U+009B as CSI).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# An escape sequence that may still be completed by the next delta.
_UNFINISHED = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|[\]PX^_][^\x07\x1b]*|[ -/]*)?\Z")
_MAX_HELD = 64


def sanitize(text: str) -> str:
    """Model or server text, minus anything a terminal would act on (keeps \\n, \\t)."""
    return _CONTROL.sub("", _ESCAPE.sub("", text))


class StreamSanitizer:
    """:func:`sanitize` for text that arrives in pieces.

    An escape sequence split across two deltas would otherwise lose its ESC in
    the first and leave its tail ("[2J") printed in the second; so an
    unfinished sequence at the end of a piece is held back (a few bytes at
    most) until the next one completes or disproves it.
    """

    def __init__(self) -> None:
        self._held = ""

    def feed(self, piece: str) -> str:
        text = self._held + piece
        self._held = ""
        start = text.rfind("\x1b")
        if start != -1 and len(text) - start <= _MAX_HELD and _UNFINISHED.match(text, start):
            text, self._held = text[:start], text[start:]
        return sanitize(text)

    def flush(self) -> str:
        text, self._held = self._held, ""
        return sanitize(text)
