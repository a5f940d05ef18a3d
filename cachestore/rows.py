"""The disk index's rows as values: a session's private segment, a content-addressed block, and what
one I/O job changed (index.py writes them; the engine's block table mirrors them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class FileRow:
    """One cache file as the index keeps it, a segment's or a block's: the ids it holds, where it is,
    its size and checksum, and the fingerprint of the model it is for."""

    start: int
    end: int
    path: Path
    nbytes: int
    checksum: str
    fingerprint: str
    tokens: tuple[int, ...]  # the ids of [start, end)


@dataclass(frozen=True)
class SegmentRow(FileRow):
    """A session's private segment (its tail after its chain's blocks)."""

    key: str  # the session


@dataclass(frozen=True)
class BlockRow(FileRow):
    """A content-addressed block, shared by every session whose ids run through it."""

    block: str  # its key: the hash chain of every id up to its end (blocks.py)
    parent: str  # the previous block's key, or the fingerprint for the first block


@dataclass(frozen=True)
class DiskNews:
    """What index writes changed (one I/O job's): sessions' chains and tails, blocks added or gone.

    The I/O worker sends it to the engine thread, whose block table (table.py)
    mirrors the index without reading it.
    """

    sessions: dict[str, tuple[list[str], list[SegmentRow]]]  # key -> (its chain's blocks, its segments)
    blocks: dict[str, BlockRow | None]  # None: gone
    others: frozenset[str] = frozenset()  # sessions whose cache for another model changed (was dropped)
