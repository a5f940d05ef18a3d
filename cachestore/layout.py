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
from pathlib import Path

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
