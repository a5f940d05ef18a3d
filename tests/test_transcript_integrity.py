"""The transcript's own integrity: a lost WAL is said out loud, damage is caught, backups roll."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

from daemon.service.backup import BACKUPS_KEPT, back_up, backups, due
from daemonproc import DaemonProcess
from sessions import Store


def test_deleted_wal_is_detected_and_named(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    with d.client() as c:
        sids = [c.request("session.create")["session"]["id"] for _ in range(3)]
        for sid in sids:
            c.chat(sid, "Something worth keeping.", max_tokens=4, temperature=0)
        d.kill()  # no checkpoint: the three sessions live only in kvd.sqlite-wal
    wal = tmp_path / "kvd.sqlite-wal"
    assert wal.stat().st_size > 0
    wal.unlink()
    (tmp_path / "kvd.sqlite-shm").unlink()

    d = DaemonProcess(tmp_path)
    try:
        with d.client() as c:
            assert c.request("session.list")["sessions"] == []
    finally:
        d.terminate()
    lost = [line for line in d.log if "TRANSCRIPTS LOST" in line]
    assert len(lost) == 1
    assert f"3 session(s) have KV caches but no transcript in {tmp_path / 'kvd.sqlite'}" in lost[0]
    assert all(sid in lost[0] for sid in sids)
    assert "was kvd.sqlite-wal deleted or damaged? restore the newest backup: cp " in lost[0]
    # The backups from before the loss are kept as they were.
    assert not any("backed up the transcript" in line for line in d.log)


def test_damage_inside_the_database_is_caught_by_quick_check(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    with d.client() as c:
        for _ in range(40):
            sid = c.request("session.create", title="a title long enough to fill pages " * 4)["session"]["id"]
        c.chat(sid, "hello", max_tokens=3, temperature=0)
    assert d.terminate() == 0
    db = tmp_path / "kvd.sqlite"
    conn = sqlite3.connect(db)
    (page_size,) = conn.execute("PRAGMA page_size").fetchone()
    # A page of table data, not the schema Store() reads first (nor a free page a dropped table left).
    (page,) = conn.execute("SELECT MAX(pageno) FROM dbstat WHERE name = 'sessions'").fetchone()
    conn.close()
    with open(db, "r+b") as f:
        f.seek((page - 1) * page_size + 8)
        f.write(b"\x7f" * (page_size - 16))
    out = subprocess.run([sys.executable, "-m", "daemon.cli", "serve", "--model", "builtin:tiny", "--port", "0",
                          "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr and "listening" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("kvd: error:")]
    assert len(errors) == 1
    assert errors[0].startswith(f"kvd: error: {db} is ")
    assert "restore the newest backup: cp " in errors[0]


def test_backups_roll(tmp_path: Path) -> None:
    store = Store(tmp_path / "kvd.sqlite")
    sid = store.create_session(title="kept")["id"]
    where = tmp_path / "backups"
    assert due(where, now=0)
    written = [back_up(tmp_path / "kvd.sqlite", where, now=1_800_000_000 + day * 86400) for day in range(5)]
    store.close()
    assert backups(where) == written[-BACKUPS_KEPT:]
    assert not due(where, now=written[-1].stat().st_mtime + 3600)
    assert due(where, now=written[-1].stat().st_mtime + 86400)
    copy = sqlite3.connect(written[-1])
    assert copy.execute("SELECT id, title FROM sessions").fetchall() == [(sid, "kept")]
    # Later the same day: it replaces that day's backup, the earlier days stay.
    again = back_up(tmp_path / "kvd.sqlite", where, now=1_800_000_000 + 4 * 86400 + 3600)
    assert backups(where) == [*written[-BACKUPS_KEPT:-1], again]
