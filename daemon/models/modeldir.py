"""Publishing a model directory atomically: build beside it, fsync, rename.

Every model kvd writes under its data directory (the built-in models, a
converted GGUF file) is built in a hidden temp dir next to its destination,
every file fsynced, then renamed into place and the parent fsynced. A crash
at any point leaves either no model or a whole one where the loader looks,
never half of one; the next start cleans up temp dirs whose writer died.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from common import durable

__all__ = ["publish_dir", "write_synced"]

_TMP_MARK = ".tmp-"


def publish_dir(dest: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool]) -> Path:
    """Return `dest`, first running `build(tmp)` and renaming tmp to dest unless
    `is_complete(dest)`. `build` writes its files with :func:`write_synced`.

    A dest that exists but is not complete (another version, a partial copy
    made by hand) is moved aside and removed. If another process published
    the same dir first, theirs is kept when complete.
    """
    if is_complete(dest):
        return dest
    parent = dest.parent
    parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_tmp(parent, dest.name)
    tmp = _tmp_path(parent, dest.name)
    tmp.mkdir()
    try:
        build(tmp)
        durable.fsync_dir(tmp)
        if dest.exists():
            # Move the bad one aside first: rename cannot replace a non-empty dir.
            trash = _tmp_path(parent, dest.name)
            os.rename(dest, trash)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not is_complete(dest):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        durable.fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def write_synced(path: Path, data: bytes) -> None:
    """A new file inside a dir being built: fsynced, not renamed (the dir is)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        durable.fsync_file(f.fileno())


def _tmp_path(parent: Path, name: str) -> Path:
    """A hidden sibling named after our pid, so a later run can tell whether
    its writer is still alive."""
    return parent / f".{name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _clean_stale_tmp(parent: Path, name: str) -> None:
    """Remove temp dirs left by a writer that died; leave live writers' alone."""
    prefix = f".{name}{_TMP_MARK}"
    for p in parent.glob(f"{prefix}*"):
        try:
            pid = int(p.name[len(prefix):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and _pid_alive(pid):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
