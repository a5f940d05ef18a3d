"""A start says TRANSCRIPTS LOST only when the transcript lost bytes, and then keeps the backups from before.

A cache that holds more than its transcript after a turn cancelled while its prompt was read, a
regenerate followed at once by a stop, or a kill -9 while a prompt is read is the cache's tail (kept as a
reusable prefix), not a loss: none of them may report one or turn backups off, on this start or the next.
A deleted kvd.sqlite-wal still does (tests/test_transcript_integrity.py), and a restored backup, or the
commit record put aside, ends the alarm. Real `kvd serve` processes (builtin:tiny, chunks of 64 tokens).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from daemon.service.backup import backups
from daemonproc import DaemonProcess, SyncClient

LONG = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog by the river." for i in range(40))
LOST = "TRANSCRIPTS LOST"
OFF = "no backups while this daemon runs"


def serve(data: Path, *args: str) -> DaemonProcess:
    config = data.parent / "losses-kvd.toml"
    config.write_text("[cache]\nprefetch = false\n[generation]\nprefill_step_size = 64\n")
    return DaemonProcess(data, "--config", str(config), *args)


def read_then(c: SyncClient, sid: str, text: str = LONG) -> str:
    """Send `text` and return once kvd has read its first chunk (its first chat.progress): mid-read."""
    rid = c.send(type="chat.send", session=sid, text=text, max_tokens=4, temperature=0)
    while (e := c.recv())["type"] != "chat.progress":
        assert e["type"] in ("chat.start", "chat.queued"), e
    return rid


def ended(c: SyncClient, rid: str) -> dict[str, object]:
    while (e := c.recv()).get("id") != rid or e["type"] not in ("chat.done", "error"):
        pass
    return e


def quiet_start(data: Path) -> None:
    """Start, say nothing of a loss, keep backing up (at shutdown); stop cleanly."""
    d = serve(data)
    with d.client() as c:
        c.request("session.list")
    assert d.terminate() == 0
    said = "".join(d.log)
    assert LOST not in said and OFF not in said, said
    assert "backed up the transcript at shutdown" in said, said


def test_a_prompt_cancelled_while_read_then_a_stop_is_no_loss(tmp_path: Path) -> None:
    data = tmp_path / "data"
    d = serve(data)
    with d.client() as c:
        sid = c.request("session.create")["session"]["id"]
        c.chat(sid, "A first short turn.", max_tokens=4, temperature=0)
        rid = read_then(c, sid)
        c.request("chat.cancel", session=sid)
        assert ended(c, rid)["type"] == "chat.done"
        c.request("status")  # its cache (the prompt read so far) is on disk
    assert d.terminate() == 0
    quiet_start(data)
    quiet_start(data)  # and the start after it


def test_a_regenerate_stopped_at_once_is_no_loss(tmp_path: Path) -> None:
    data = tmp_path / "data"
    d = serve(data)
    with d.client() as c:
        sid = c.request("session.create")["session"]["id"]
        c.chat(sid, LONG, max_tokens=24, temperature=0)
        c.request("status")  # the answer's cache is on disk
        # Another session reads a long prompt meanwhile, so the regenerate waits its turn when kvd stops.
        other = c.request("session.create")["session"]["id"]
        read_then(c, other, " ".join([LONG] * 2))
        rid = c.send(type="chat.regenerate", session=sid, max_tokens=24, temperature=0)
        while (e := c.recv()).get("id") != rid:
            pass
        assert e["type"] in ("chat.start", "chat.queued"), e
        assert d.terminate() == 0  # at once
    quiet_start(data)
    quiet_start(data)


def test_a_kill_while_a_prompt_is_read_is_no_loss(tmp_path: Path) -> None:
    for model in ("builtin:tiny", "builtin:tiny-swa"):  # a sliding window writes blocks while it reads
        data = tmp_path / model.replace(":", "-")
        d = serve(data, "--model", model)
        with d.client() as c:
            sid = c.request("session.create")["session"]["id"]
            c.chat(sid, "A first short turn.", max_tokens=4, temperature=0)
            read_then(c, sid)
            d.kill()
        d = serve(data, "--model", model)
        with d.client() as c:
            assert c.request("session.list")["sessions"]
        assert d.terminate() == 0
        said = "".join(d.log)
        assert LOST not in said and OFF not in said, said
        quiet_start(data)  # the start after the one that marked the cut answer


def test_a_lost_wal_is_said_until_a_backup_is_restored(tmp_path: Path) -> None:
    data = tmp_path / "data"
    d = serve(data)
    with d.client() as c:
        sid = c.request("session.create")["session"]["id"]
        c.chat(sid, "Kept.", max_tokens=4, temperature=0)
    assert d.terminate() == 0  # a checkpoint and a backup
    d = serve(data)
    with d.client() as c:
        c.chat(sid, "Lost with the WAL.", max_tokens=4, temperature=0)
        d.kill()
    (data / "kvd.sqlite-wal").unlink()
    (data / "kvd.sqlite-shm").unlink(missing_ok=True)
    for _ in range(2):  # said on every start, backups kept as they were, until something is done about it
        d = serve(data)
        with d.client() as c:
            c.chat(sid, "A turn after the loss.", max_tokens=4, temperature=0)
        assert d.terminate() == 0
        said = "".join(d.log)
        assert said.count(LOST) == 1 and OFF in said, said
        assert "backed up the transcript" not in said
    # Going on without them, as the line says: its note put aside.
    other = tmp_path / "going-on"
    shutil.copytree(data, other)
    (other / "kvd.sqlite.commits").unlink()
    quiet_start(other)
    # The newest backup put back (from before the loss: none was written since).
    shutil.copyfile(backups(data / "backups")[-1], data / "kvd.sqlite")
    for suffix in ("-wal", "-shm"):
        (data / f"kvd.sqlite{suffix}").unlink(missing_ok=True)
    quiet_start(data)
