"""A lost cache index is rebuilt from the cache files' own headers by a real `kvd serve`.

Blocks of 16 ids: the two sessions begin alike, so they share blocks, and a
rebuilt index must find each session's chain of blocks again.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from conftest import fed_tokens
from daemonproc import DaemonProcess


def _rows(cache: Path) -> set[tuple[object, ...]]:
    db = sqlite3.connect(cache / "index.sqlite")
    try:
        return (set(db.execute('SELECT key, start, "end", checksum, fingerprint, tokens FROM segments'))
                | set(db.execute('SELECT block, parent, start, "end", checksum, fingerprint, tokens FROM blocks'))
                | set(db.execute("SELECT key, n, block FROM chains")))
    finally:
        db.close()


@pytest.mark.parametrize("damage", ["deleted", "zero bytes", "zeroed"])
def test_lost_index_is_rebuilt_from_the_files(tmp_path: Path, damage: str) -> None:
    d = DaemonProcess(tmp_path, block_tokens=16)
    with d.client() as c:
        sids = [c.request("session.create")["session"]["id"] for _ in range(2)]
        for sid in sids:
            for text in ("First turn of a conversation.", "And a second one."):
                c.chat(sid, text, max_tokens=8, temperature=0)
    assert d.terminate() == 0
    cache = tmp_path / "cache"
    before = _rows(cache)
    fed = fed_tokens(tmp_path / "kvd.sqlite", sids[0])
    db = sqlite3.connect(cache / "index.sqlite")
    segments, blocks, shared = db.execute(
        "SELECT (SELECT COUNT(*) FROM segments), (SELECT COUNT(*) FROM blocks), "
        "(SELECT COUNT(*) FROM (SELECT block FROM chains GROUP BY block HAVING COUNT(*) > 1))").fetchone()
    db.close()
    assert segments >= 2 and blocks >= 2 and shared >= 1  # the sessions share their first block(s)
    index = cache / "index.sqlite"
    for suffix in ("-wal", "-shm"):
        Path(f"{index}{suffix}").unlink(missing_ok=True)
    if damage == "deleted":
        index.unlink()
        how = "missing"
    elif damage == "zero bytes":
        index.write_bytes(b"")
        how = "empty"
    else:
        index.write_bytes(b"\0" * 8192)
        how = "damaged (file is not a database), set aside as index.sqlite.damaged-"
    # A file that does not verify: a valid segment under a name that lies about its range.
    first = sorted((cache / "segments" / sids[0]).rglob("*.safetensors"))[0]
    shutil.copy(first, first.with_name("0000000000-0000000001.safetensors"))

    d = DaemonProcess(tmp_path, block_tokens=16)
    try:
        with d.client() as c:
            rebuilt = _rows(cache)  # the model is loaded: the index was rebuilt
            _, done = c.chat(sids[0], "After the index was lost?", max_tokens=4, temperature=0)
    finally:
        d.terminate()
    log = "".join(d.log)
    assert f"the cache index {index} was {how}" in log
    assert (f"rebuilt it from the cache files' own headers: {segments} file(s) of 2 session(s) and "
            f"{blocks} block(s) kept, 1 that did not verify removed (first: ") in log
    assert "its name does not match its range" in log
    assert "left incomplete by a crash" not in log
    # Exactly what the lost index listed: files, blocks and each session's chain.
    assert rebuilt == before
    assert done["usage"]["restored_from"] == "disk"
    assert done["usage"]["restored_tokens"] == len(fed)  # every token fed before the loss


def test_an_index_from_kvds_own_migration_runner_carries_over(tmp_path: Path) -> None:
    """An index whose migrations kvd's earlier runner recorded (in _kvd_migrations) is kept, not
    rebuilt: the names move to sqlite-utils' table and only the later migrations run."""
    from sqlite_utils import Database

    from cachestore.index import SegmentIndex
    from cachestore.migrations import m001_segments
    from common.migrate import LEGACY_TABLE

    (tmp_path / "segments").mkdir()
    db = Database(tmp_path / "index.sqlite")
    db.execute(f"CREATE TABLE {LEGACY_TABLE} (name TEXT PRIMARY KEY, applied_at REAL)")
    m001_segments(db)
    db.execute(f"INSERT INTO {LEGACY_TABLE} VALUES ('m001_segments', 1)")
    db.conn.commit()
    db.close()
    index = SegmentIndex(tmp_path)
    assert index.lost is None  # an existing index, not an empty one to rebuild
    names = [r[0] for r in index.db.execute(
        "SELECT name FROM _sqlite_migrations WHERE migration_set = 'kvd.cache' ORDER BY id")]
    assert names == ["m001_segments", "m002_blocks", "m003_per_model"]
    tables = {r[0] for r in index.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"segments", "blocks", "chains"} <= tables and LEGACY_TABLE not in tables
    index.close()
