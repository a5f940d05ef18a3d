"""Segment files, the on-disk tier: one :class:`~cachestore.snapshot.Snapshot` per file.

The front door for the three modules that do the work: the format itself
(:mod:`cachestore.segformat`), writing a durable file
(:mod:`cachestore.segwrite`) and checking an untrusted one before MLX reads a
byte (:mod:`cachestore.segread`).
"""

from __future__ import annotations

from .segformat import FORMAT_VERSION, fingerprint
from .segread import SegmentHeader, read_header, read_segment
from .segwrite import SegmentFile, write_segment

__all__ = [
    "FORMAT_VERSION",
    "SegmentFile",
    "SegmentHeader",
    "fingerprint",
    "read_header",
    "read_segment",
    "write_segment",
]
