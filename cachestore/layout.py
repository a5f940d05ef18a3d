"""Where the disk tier keeps its files under the cache directory, and the checks a start makes on them.

    <cache_dir>/index.sqlite      the index (segments, blocks, chains)
    <cache_dir>/segments/<sid>/   each session's private segment files
    <cache_dir>/blocks/           content-addressed blocks, shared by chains

`kvd serve`'s preflight asks through these functions (re-exported by the
package's front door) instead of reading the directories itself.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

from common.tokenids import unpack_tokens

SEGMENTS = "segments"
BLOCKS = "blocks"
INDEX = "index.sqlite"


def check_usable(cache_dir: Path) -> Path:
    """Create the layout if missing and check kvd may read and write all of it.

    Raises OSError whose `filename` names the first file or directory that is
    not usable; returns the directory a write probe should go to.
    """
    segments = cache_dir / SEGMENTS
    segments.mkdir(parents=True, exist_ok=True, mode=0o700)
    index = cache_dir / INDEX
    for p in (index, index.with_name(INDEX + "-wal"), index.with_name(INDEX + "-shm")):
        if p.exists():
            os.close(os.open(p, os.O_RDWR))
    for d in [segments, *(p for p in segments.iterdir() if p.is_dir())]:
        if not os.access(d, os.R_OK | os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "Permission denied", str(d))
    return segments


def cached_session_ids(cache_dir: Path) -> set[str]:
    """The sessions the disk tier holds private files for (a directory each, named by its id)."""
    segments = cache_dir / SEGMENTS
    if not segments.is_dir():
        return set()
    return {p.name for p in segments.iterdir() if p.is_dir()}


def disk_ids(root: Path) -> dict[str, tuple[int, ...]]:
    """Each session's token ids as its disk chain holds them (its blocks, then its segments), for the
    model that used the session last.

    Read only, through a connection of its own, before anything else opens
    the index: a fact for the transcript's check at start (which turns a
    lost WAL took), never a reason to fail. An index that cannot be read
    gives no facts.
    """
    path = root / INDEX
    if not path.is_file():
        return {}
    found: dict[tuple[str, str], list[int]] = {}
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            for key, model, blob in db.execute(
                    "SELECT c.key, c.fingerprint, b.tokens FROM chains c JOIN blocks b ON b.block = c.block "
                    "ORDER BY c.key, c.fingerprint, c.n"):
                found.setdefault((key, model), []).extend(unpack_tokens(blob))
            for key, model, blob in db.execute("SELECT key, fingerprint, tokens FROM segments "
                                               "ORDER BY key, fingerprint, start"):
                found.setdefault((key, model), []).extend(unpack_tokens(blob))
            by_use = db.execute("SELECT key, fingerprint FROM keys ORDER BY last_used").fetchall()
        finally:
            db.close()
    except (sqlite3.Error, ValueError):
        return {}
    # One model's ids per session: the one that used it last (the transcript's fed ids are its).
    return {key: tuple(found[key, model]) for key, model in by_use if (key, model) in found}
