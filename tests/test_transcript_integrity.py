"""The transcript's own integrity: a lost WAL is said out loud, damage is caught, backups roll."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
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
        # A cache reaches disk after its answer, on the I/O worker: wait for the third one.
        deadline = time.monotonic() + 60
        while c.request("status")["tiers"]["disk"]["sessions"] < len(sids):
            assert time.monotonic() < deadline, "the three caches did not reach disk within 60 s"
            time.sleep(0.05)  # poll interval, not synchronisation: the deadline bounds the wait
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


def test_a_transcript_that_lost_its_last_turns_is_named_and_the_backup_suggested_holds_as_much(
        tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    with d.client() as c:
        sid = c.request("session.create")["session"]["id"]
        kept = c.request("session.create")["session"]["id"]
        for text in ("First turn.", "Second turn."):
            c.chat(sid, text, max_tokens=4, temperature=0)
        c.chat(kept, "Untouched.", max_tokens=4, temperature=0)
    assert d.terminate() == 0  # a checkpoint, and a backup holding both sessions as they are now
    d = DaemonProcess(tmp_path)
    with d.client() as c:
        for text in ("Third turn.", "Fourth turn."):
            c.chat(sid, text, max_tokens=4, temperature=0)
        c.request("status")  # the caches of those turns are on disk
        d.kill()  # no checkpoint: the last two turns live only in kvd.sqlite-wal
    (tmp_path / "kvd.sqlite-wal").unlink()
    (tmp_path / "kvd.sqlite-shm").unlink()

    d = DaemonProcess(tmp_path)
    try:
        with d.client() as c:
            assert len(c.request("session.get", session=sid)["messages"]) == 4  # 8 before the loss
    finally:
        d.terminate()
    lost = [line for line in d.log if "TRANSCRIPTS LOST" in line]
    assert len(lost) == 1, d.log
    assert f"1 session(s) in {tmp_path / 'kvd.sqlite'} end before what their KV caches were fed: {sid} (" in lost[0]
    assert kept not in lost[0]
    assert "restore the newest backup: cp " in lost[0]
    assert not any("backed up the transcript" in line for line in d.log)


def test_a_backup_holding_less_than_the_damaged_database_is_never_suggested(tmp_path: Path) -> None:
    from daemon.service.preflight import restore_hint

    where = tmp_path / "backups"
    empty = Store(tmp_path / "empty.sqlite")
    empty.close()
    back_up(tmp_path / "empty.sqlite", where, now=1_800_000_000)  # like the one taken at the first start
    store = Store(tmp_path / "kvd.sqlite")
    sid = store.create_session(title="kept")["id"]
    store.append_message(sid, "user", "hello")
    store.close()
    hint = restore_hint(tmp_path / "kvd.sqlite", where)
    assert "cp " not in hint
    assert "holds less than kvd.sqlite still does (1 session(s), 1 message(s)), so keep it" in hint
    fuller = back_up(tmp_path / "kvd.sqlite", where, now=1_800_000_000 + 86400)
    assert f"restore the newest backup: cp {fuller} " in restore_hint(tmp_path / "kvd.sqlite", where)
    back_up(tmp_path / "empty.sqlite", where, now=1_800_000_000 + 2 * 86400)  # newer, and emptier
    assert (f"restore the newest backup that holds as much as it still does (newer ones hold less): cp {fuller} "
            in restore_hint(tmp_path / "kvd.sqlite", where))


def test_a_backup_is_wanted_daily_and_after_new_messages(tmp_path: Path) -> None:
    from daemon.service.backup import AFTER_MESSAGES, wanted

    where = tmp_path / "backups"
    store = Store(tmp_path / "kvd.sqlite")
    sid = store.create_session(title="busy")["id"]
    assert wanted(0, where) == "daily"  # none yet
    made = back_up(tmp_path / "kvd.sqlite", where)
    assert wanted(0, where) is None
    for i in range(AFTER_MESSAGES - 1):
        store.append_message(sid, "user", f"m{i}")
    assert wanted(AFTER_MESSAGES - 1, where) is None
    store.append_message(sid, "user", "one more")
    assert wanted(AFTER_MESSAGES, where) == f"after {AFTER_MESSAGES} new messages"
    assert wanted(AFTER_MESSAGES, where, now=made.stat().st_mtime + 86400) == "daily"
    store.close()
