"""protocol.durable (every file kvd replaces) and protocol.tokenids (every token-id blob).

The crash paths of a durable write are tested where they matter most, on
segment files (test_segments.py: the fsync/rename/fsync order, a failed write,
a process killed mid-write); here the helper's own promises.
"""

from __future__ import annotations

import base64
import os
import struct
from pathlib import Path

import pytest

from cachestore.segformat import decode_tokens, encode_tokens
from common import durable
from common.tokenids import pack_tokens, unpack_tokens


def test_write_atomic_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "daemon.json"
    durable.write_atomic(path, "first")
    durable.write_atomic(path, b"second", mode=0o600)
    assert path.read_text() == "second"
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["daemon.json"]


def test_mode_is_masked_by_the_umask_like_any_new_file(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        durable.write_atomic(tmp_path / "export.md", "# chat\n")
    finally:
        os.umask(old)
    assert (tmp_path / "export.md").stat().st_mode & 0o777 == 0o640


def test_a_failing_writer_leaves_the_old_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "token"
    durable.write_atomic(path, "old\n")
    with pytest.raises(OSError, match="No space"):
        with durable.replacing(path) as f:
            f.write(b"half of the new")
            raise OSError(28, "No space left on device")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["token"]


def test_replace_takes_a_file_someone_else_wrote(tmp_path: Path) -> None:
    tmp = durable.temp_path(tmp_path / "backup.sqlite")
    assert tmp.parent == tmp_path and tmp.name.startswith(".backup.sqlite.")
    assert tmp.name.endswith(durable.TEMP_SUFFIX)
    tmp.write_bytes(b"SQLite format 3\0")
    durable.replace(tmp, tmp_path / "backup.sqlite")
    assert [p.name for p in tmp_path.iterdir()] == ["backup.sqlite"]


IDS = [0, 1, 151_643, 2**31, 2**32 - 1]


def test_one_token_blob_everywhere() -> None:
    """Little-endian uint32 in the transcript and the cache index, base64'd in segment headers."""
    blob = pack_tokens(IDS)
    assert blob == struct.pack("<5I", *IDS)
    assert unpack_tokens(blob) == IDS
    assert base64.b64decode(encode_tokens(IDS)) == blob
    assert decode_tokens(encode_tokens(IDS)) == IDS


def test_a_blob_that_is_not_whole_ids_is_refused() -> None:
    with pytest.raises(ValueError):
        unpack_tokens(b"\x01\x02\x03")
    with pytest.raises(ValueError):
        decode_tokens("not base64!")
