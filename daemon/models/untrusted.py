"""Reading another program's model store as untrusted input.

Ollama's manifests and the Hugging Face cache's refs and config.json are
written by other tools and may be written by anyone who can write the store:
the same class as Ollama's CVE-2024-37032, where a manifest digest of
``../../x`` walked out of ``blobs/``. So every path a store names is checked
*after* its symlinks are resolved (:func:`inside`), and a small file is read
only if it is a regular file, opened non-blocking (a FIFO swapped in after
the check cannot hang the start), up to a size cap (a 165 MB manifest or a
link to ``/dev/zero`` is refused after cap + 1 bytes), and parsed as JSON
only below a nesting bound (100,000 nested ``[`` is a refusal, not a
RecursionError).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from common.printable import printable

__all__ = ["MAX_DEPTH", "StoreError", "inside", "printable", "read_json", "read_small"]

#: Deepest JSON nesting accepted: Ollama manifests nest 3 deep, HF configs rarely past 5.
MAX_DEPTH = 64


class StoreError(Exception):
    """A file in a store is not what the store's layout says it should be; the message says which and why."""


def inside(path: Path, root: Path) -> Path:
    """`path` with every symlink resolved, if that is `root` (resolved) or below it; else StoreError."""
    real = Path(os.path.realpath(path))
    top = Path(os.path.realpath(root))
    if real != top and top not in real.parents:
        raise StoreError(f"{printable(str(path))} leads to {printable(str(real))}, outside {printable(str(top))}")
    return real


def read_small(path: Path, root: Path | None, cap: int) -> bytes:
    """The bytes of the regular file `path` inside `root` (None: anywhere), at most `cap` of them;
    else StoreError (FileNotFoundError where there is no such file)."""
    real = inside(path, root) if root is not None else Path(os.path.realpath(path))
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise StoreError(f"{printable(str(path))} cannot be opened ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StoreError(f"{printable(str(path))} is not a regular file")
        if st.st_size > cap:
            raise StoreError(f"{printable(str(path))} is {st.st_size:,} bytes, more than the {cap:,} kvd reads")
        data = os.read(fd, cap + 1)
        if len(data) > cap:  # grew since fstat
            raise StoreError(f"{printable(str(path))} is more than the {cap:,} bytes kvd reads")
        return data
    finally:
        os.close(fd)


# A JSON string (escapes included; an unterminated one runs to the end, so no start is scanned twice and
# the walk stays linear), then any bracket: what the depth count walks.
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*+(?:"|\Z)|[\[\]{}]', re.DOTALL)


def _depth(data: bytes) -> int:
    depth = deepest = 0
    for m in _TOKEN.finditer(data):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                break
        elif c in (b"]", b"}"):
            depth -= 1
    return deepest


def read_json(path: Path, root: Path | None, cap: int) -> dict[str, Any]:
    """The JSON object in the regular file `path` inside `root` (see :func:`read_small`); else StoreError."""
    data = read_small(path, root, cap)
    if _depth(data) > MAX_DEPTH:
        raise StoreError(f"{printable(str(path))} nests deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise StoreError(f"{printable(str(path))} is not JSON ({printable(str(e))[:200]})") from None
    if not isinstance(value, dict):
        raise StoreError(f"{printable(str(path))} holds a JSON {type(value).__name__}, not an object")
    return value

