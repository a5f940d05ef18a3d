"""Errors raised by the cache store.

::

    CacheError
    ├── SnapshotError            a cache cannot be snapshotted, restored or combined
    │   └── CannotSplit          a split/truncate point this snapshot cannot reach
    └── CorruptSegment           a segment file must not be loaded (``.reason`` says why)
        ├── SegmentMissing       "missing": no file at the path, or it cannot be read
        ├── SegmentTruncated     "truncated": shorter than its own header says
        ├── ChecksumMismatch     "checksum": the bytes are not the bytes that were written
        ├── FingerprintMismatch  "fingerprint": written for another model/config/layout
        ├── UnsupportedFormat    "format": not a kvd segment, or a version we cannot read
        └── InvariantViolation   "invariant": readable, but not a state a cache can be in

None of these is meant for the user as such. ``SnapshotError`` is a bug or a
misuse in the caller (the daemon falls back to a full prefill). A
``CorruptSegment`` is expected now and then (a crash, a bad disk, a model
upgrade): the daemon drops the file and its index row and rebuilds the
session from its transcript, which is slower but loses nothing.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "CacheError",
    "CannotSplit",
    "ChecksumMismatch",
    "CorruptSegment",
    "FingerprintMismatch",
    "InvariantViolation",
    "SegmentMissing",
    "SegmentTruncated",
    "SnapshotError",
    "UnsupportedFormat",
]


class CacheError(Exception):
    """Base class of every error the cache store raises."""


class SnapshotError(CacheError):
    """A cache cannot be snapshotted, restored, merged or rewound as asked."""


class CannotSplit(SnapshotError):
    """The snapshot holds state that has no earlier point to cut at.

    Rotating (sliding-window) layers keep only the last window and recurrent
    layers only their state at one offset, so neither can be cut; the point
    can also simply lie outside the snapshot's range.
    """


class CorruptSegment(CacheError):
    """A segment file failed verification and must be dropped, never loaded."""

    #: One of "missing", "truncated", "checksum", "fingerprint", "format", "invariant".
    reason: str = "corrupt"

    def __init__(self, detail: str, *, path: Path | str | None = None) -> None:
        self.detail = detail
        self.path = Path(path) if path is not None else None
        where = f"{self.path}: " if self.path is not None else ""
        super().__init__(f"{where}{self.reason}: {detail}")


class SegmentMissing(CorruptSegment):
    reason = "missing"


class SegmentTruncated(CorruptSegment):
    reason = "truncated"


class ChecksumMismatch(CorruptSegment):
    reason = "checksum"


class FingerprintMismatch(CorruptSegment):
    reason = "fingerprint"


class UnsupportedFormat(CorruptSegment):
    reason = "format"


class InvariantViolation(CorruptSegment):
    reason = "invariant"
