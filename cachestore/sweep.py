"""The start's sweep of the cache directory: files a crash left unlisted, rows whose files are gone."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .index import SegmentIndex

log = logging.getLogger("kvd.cache")


def sweep(index: SegmentIndex) -> int:
    """Delete files no row lists (a crash before indexing) and cut chains at files that are gone.

    A listed file can be gone after a crash between an eviction's unlink
    and its unlisting, or when that unlisting rolled back on a full disk.
    A gone block cuts every chain that lists it (its successors with it,
    as a damaged block does); a gone segment cuts its session's segments
    from there. Either way those sessions prefill from the cut.
    """
    removed = 0
    present: dict[str, set[str]] = {}
    for table, root in (("segments", index.files), ("blocks", index.blocks)):
        # Names as kvd writes them (posix, relative to the root), compared as strings: no stat per row.
        listed = {r[0] for r in index.db.execute(f"SELECT file FROM {table}")}
        found = present[table] = _files_under(root)
        for rel in sorted(found - listed):
            (root / rel).unlink(missing_ok=True)
            removed += 1
    for key, model, start, rel in index.db.execute(
            "SELECT key, fingerprint, start, file FROM segments ORDER BY key, fingerprint, start").fetchall():
        if rel not in present["segments"] and index.listed("segments", "file", rel):
            removed += sum(1 for r in index.chain(key, model) if r.start >= start)
            index.drop_segments(key, start, model)
            log.warning("cache file %s is missing; session %s will prefill from token %d",
                        index.files / rel, key, start)
    for block, start, rel in index.db.execute("SELECT block, start, file FROM blocks ORDER BY start").fetchall():
        # An earlier cut may have unlisted (and deleted) this block already: it followed a gone one.
        if rel not in present["blocks"] and index.listed("blocks", "block", block):
            cut = index.drop_block(block)
            removed += 1
            log.warning("cache block %s is missing; %d session(s) that listed it will prefill "
                        "from token %d", index.blocks / rel, len(cut), start)
    for d in sorted(index.files.glob("*/*/"), reverse=True) + sorted(index.files.iterdir()):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()  # a model's directory left empty, then a session's
    return removed


def _files_under(root: Path) -> set[str]:
    """Every file below `root`, as its posix path relative to `root` (one directory listing each, no stat)."""
    found: set[str] = set()
    for here, _dirs, names in os.walk(root):
        rel = Path(here).relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        found.update(prefix + name for name in names)
    return found
