"""JSON nested past a fixed depth is refused the same way on every Python.

kvd relied on `json.loads` raising RecursionError for a deeply nested
document. That depends on the interpreter: Python 3.11 stops near 1,000
levels, 3.12 parses 5,000 (found on the GPU machine's Python 3.12, where a
websocket frame nested 5,000 deep was answered as a ping). So the depth is
checked after parsing, against one limit: deeper than any request kvd reads
(its frames are a few levels, an API body with a JSON schema a few dozen)
and shallow enough for any consumer that recurses over the value.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 256


class NestedTooDeep(RecursionError):
    """A RecursionError, so that every caller's `except RecursionError` answers it as before."""


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether lists and objects nest more than `limit` levels (iterative: any depth is safe to ask)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def check_depth(value: Any, text: str | bytes, limit: int = MAX_DEPTH) -> Any:
    """`value` (parsed from `text`), or NestedTooDeep. The walk runs only when `text` holds more
    brackets than the limit, which counting finds at memory speed."""
    opens = (b"[", b"{") if isinstance(text, bytes) else ("[", "{")
    if text.count(opens[0]) + text.count(opens[1]) > limit and too_deep(value, limit):  # type: ignore[arg-type]
        raise NestedTooDeep(f"nested more than {limit} levels deep")
    return value


def loads(text: str | bytes, limit: int = MAX_DEPTH) -> Any:
    """`json.loads`, refusing a document nested more than `limit` levels (NestedTooDeep)."""
    return check_depth(json.loads(text), text, limit)
