"""A lost cache index is rebuilt from the segment files' own headers by a real `kvd serve`."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from conftest import fed_tokens
from daemonproc import DaemonProcess


def _rows(cache: Path) -> set[tuple[str, int, int, str, str, bytes]]:
    db = sqlite3.connect(cache / "index.sqlite")
    try:
        return set(db.execute('SELECT key, start, "end", checksum, fingerprint, tokens FROM segments'))
    finally:
        db.close()


@pytest.mark.parametrize("damage", ["deleted", "zero bytes", "zeroed"])
def test_lost_index_is_rebuilt_from_the_files(tmp_path: Path, damage: str) -> None:
    d = DaemonProcess(tmp_path)
    with d.client() as c:
        sids = [c.request("session.create")["session"]["id"] for _ in range(2)]
        for sid in sids:
            for text in ("First turn of a conversation.", "And a second one."):
                c.chat(sid, text, max_tokens=8, temperature=0)
    assert d.terminate() == 0
    cache = tmp_path / "cache"
    before = _rows(cache)
    fed = fed_tokens(tmp_path / "kvd.sqlite", sids[0])
    assert len(before) == 4
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
    first = sorted((cache / "segments" / sids[0]).iterdir())[0]
    shutil.copy(first, first.with_name("0000000000-0000000001.safetensors"))

    d = DaemonProcess(tmp_path)
    try:
        with d.client() as c:
            _, done = c.chat(sids[0], "After the index was lost?", max_tokens=4, temperature=0)
    finally:
        d.terminate()
    log = "".join(d.log)
    assert f"the cache index {index} was {how}" in log
    assert ("rebuilt it from the cache files' own headers: 4 file(s) of 2 session(s) kept, 1 that did "
            "not verify removed (first: ") in log
    assert "its name does not match its range" in log
    assert "left incomplete by a crash" not in log
    # Exactly what the lost index listed (the new turn adds its own segment).
    assert before <= _rows(cache)
    assert done["usage"]["restored_from"] == "disk"
    assert done["usage"]["restored_tokens"] == len(fed)  # every token fed before the loss
