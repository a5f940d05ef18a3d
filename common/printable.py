"""Text from outside (a file name in a model store, a URL in a file) made safe for one terminal line.

Every terminal control character is written as its Python escape (``\\x1b``,
``\\n``) rather than dropped, so the line still says what was there but
cannot move the cursor, retitle the window or split into two lines.
Standard library only.
"""

from __future__ import annotations

import re

__all__ = ["printable"]

# C0 controls (all of them: a newline would split the one error line), DEL and the C1 controls.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with every terminal control character written as a Python escape (``\\x1b``, ``\\n``)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)
