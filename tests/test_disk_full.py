"""A full disk: `disk_full` for requests (nothing acknowledged lost), LRU eviction for caches.

Fault injection runs everywhere (SQLite's page limit; a cache filesystem of a
fixed capacity); a real small tmpfs runs where the test may mount one (root).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import cachestore.writeback as writeback
from cachestore.store import SessionCaches
from conftest import client, running_daemon
from daemonproc import DaemonProcess
from sessions import Store, is_disk_full
from test_store_tiers import Clock, budgets, grow

A, B, C = "aaaa", "bbbb", "cccc"


@pytest.mark.anyio
async def test_full_transcript_disk_is_disk_full_and_loses_nothing(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model="builtin:tiny") as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            _, done = await c.chat(sid, "hello", max_tokens=4, temperature=0)
            assert done["type"] == "chat.done"
            before = (await c.request("session.get", session=sid))["messages"]
            # The disk fills up: no page beyond the current ones, and those filled to the brim.
            db = d.store.db
            with writer_stopped(d):
                fill(d.store)

            created = await c.request("session.create")
            assert (created["type"], created["code"]) == ("error", "disk_full")
            assert "disk holding kvd's data directory is full" in created["message"]
            _, refused = await c.chat(sid, "a message that does not fit " * 40, max_tokens=4)
            assert (refused["type"], refused.get("code")) == ("error", "disk_full"), refused
            # Sent again at once: the turn had ended before its error was published, so the retry gets the
            # real state (the disk, still full), never `busy`.
            _, again = await c.chat(sid, "a message that does not fit " * 40, max_tokens=4)
            assert (again["type"], again.get("code")) == ("error", "disk_full"), again
            assert (await c.request("ping"))["type"] == "pong"  # still serving
            # Nothing acknowledged was lost, and the refused message was not half-kept.
            assert (await c.request("session.get", session=sid))["messages"] == before

            db.execute("PRAGMA max_page_count = 1073741823")  # room again
            _, done = await c.chat(sid, "and now?", max_tokens=4, temperature=0)
            assert done["type"] == "chat.done"


@contextlib.contextmanager
def writer_stopped(d: Any) -> Iterator[None]:
    """The transcript writer stopped (what it was given committed first) while a test fills the disk from the
    event loop, then started again. The loop never touches SQLite while kvd serves (sessions/writer.py): with
    the writer running, a streamed chunk's commit could run on the same connection inside the filling, the
    full disk's rollback taking its transaction (and savepoint) with it ("no such savepoint", told as an
    internal error: seen under two CPU burners)."""
    writer = d.daemon.turns.transcripts.writer
    writer.close()
    try:
        yield
    finally:
        writer.start()


def fill(store: Store) -> None:
    """The transcript's disk full to the brim (SQLite's page limit), while nothing is being written."""
    filler = store.create_session(title="New chat")["id"]
    (pages,) = store.db.execute("PRAGMA page_count").fetchone()
    store.db.execute(f"PRAGMA max_page_count = {pages}")
    more: Callable[[], object]
    for more in (lambda: store.create_session(title="filler " * 20), lambda: store.create_session(title="x"),
                 lambda: store.append_message(filler, "user", "x" * 500),
                 lambda: store.append_message(filler, "user", "x")):
        with pytest.raises(Exception) as full:
            while True:
                more()
        assert is_disk_full(full.value)


@pytest.mark.anyio
async def test_an_answer_a_full_disk_cuts_is_told_kept_and_shown_failed_after_a_restart(tmp_path: Path) -> None:
    """What the client is told live agrees with what GET shows, then and after a restart: the answer cut by a
    full disk keeps what was written of it, as a failed response; a request the full disk refuses whole is
    told "not saved", and there is no response to get."""
    import openai

    from test_openai_http import HeldEnds

    async with running_daemon(tmp_path, model="builtin:tiny") as d:
        base = d.url.replace("ws://", "http://")
        async with openai.AsyncOpenAI(base_url=base, api_key=d.token, max_retries=0) as api:
            ends = HeldEnds(d)  # the answer stays under way while the disk fills
            events = []
            async with api.responses.stream(model="builtin:tiny", input="Tell me a story.", temperature=0,
                                            max_output_tokens=64) as stream:
                async for event in stream:
                    events.append(event)
                    if event.type == "response.output_text.delta" and not ends.released:
                        with writer_stopped(d):  # its first part is written, and nothing else under the filling
                            fill(d.store)
                        ends.release()
            failed = events[-1]
            assert failed.type == "response.failed", [e.type for e in events]
            assert failed.response.error is not None
            told = failed.response.error.message
            assert "the answer was cut here: what was written of it is kept, marked failed" in told, told
            got = await api.responses.retrieve(failed.response.id)
            assert got.status == "failed" and got.output_text, got
            kept = got.output_text
            with pytest.raises(openai.APIStatusError) as refused:  # the disk still full: nothing of it kept
                await api.responses.create(model="builtin:tiny", input="Another one.", max_output_tokens=8)
            assert "so this was not saved" in refused.value.message
            assert d.store.db.execute("SELECT COUNT(*) FROM responses").fetchone() == (1,)  # none to get
        d.store.db.execute("PRAGMA max_page_count = 1073741823")  # room again
    async with running_daemon(tmp_path, model="builtin:tiny") as d:
        base = d.url.replace("ws://", "http://")
        async with openai.AsyncOpenAI(base_url=base, api_key=d.token, max_retries=0) as api:
            again = await api.responses.retrieve(failed.response.id)
            assert again.status == "failed" and again.output_text == kept


@pytest.fixture
def model(models: dict[str, Any]) -> Any:
    return models["builtin:tiny"]


def test_full_cache_disk_evicts_the_least_recently_used(model: Any, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A cache filesystem that holds two sessions' files (injected ENOSPC past that)."""
    real_write = writeback.write_segment  # type: ignore[attr-defined]  # what the writer calls, patched below
    capacity = 0

    def write_on_small_disk(path: Path, *args: Any, **kwargs: Any) -> Any:
        seg = real_write(path, *args, **kwargs)
        if caches.index.total_bytes() + seg.nbytes > capacity:
            seg.path.unlink()
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return seg

    monkeypatch.setattr(writeback, "write_segment", write_on_small_disk)
    clock = Clock()
    caches = SessionCaches(tmp_path, "fp", budgets(), clock=clock)
    sessions = {}
    for key in (A, B, C):
        sessions[key] = grow(model, None, [], list(range(10, 40)))
    one = 30 * 2048 + 8192
    capacity = 2 * one
    caplog.set_level(logging.INFO)
    for key in (A, B, C):
        clock.now += 1
        caches.checkin(key, *sessions[key])
    caches.flush()
    assert [k for k, _ in caches.index.keys_by_use()] == [B, C]
    assert caches.statistics()["disk"]["evicted_full"] == 1
    assert any(f"removed the cache files of session {A}" in r.getMessage() and f"room for {C}" in r.getMessage()
               for r in caplog.records)
    # Nothing left to evict and one session does not fit: it stays resident, said so.
    capacity = 1000
    cache, toks = grow(model, None, [], list(range(50, 90)))
    caches.checkin("dddd", cache, toks)
    caches.flush()
    assert "dddd" in caches.resident and caches.index.chain("dddd") == []
    assert any("(no other session's cache is left to remove); the cache of dddd stays in memory only"
               in r.getMessage() for r in caplog.records)
    caches.close()


@pytest.mark.skipif(os.getuid() != 0, reason="mounting a small tmpfs needs root")
def test_full_cache_filesystem_on_a_real_tmpfs(tmp_path: Path) -> None:
    data = tmp_path / "data"
    cache = data / "cache"
    cache.mkdir(parents=True, mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(cache)], check=True)
    try:
        d = DaemonProcess(data)
        try:
            sids = []
            with d.client() as c:
                for i in range(5):
                    sid = c.request("session.create")["session"]["id"]
                    sids.append(sid)
                    _, done = c.chat(sid, f"Conversation {i}: " + "tell me more about this. " * 90,
                                     max_tokens=8, temperature=0)
                    assert done["type"] == "chat.done", done
                status = c.request("status")
                # Before shutdown pages the resident caches out into whatever room is left.
                on_disk = {p.name for p in (cache / "segments").iterdir() if any(p.iterdir())}
        finally:
            assert d.terminate() == 0
        log = "".join(d.log)
        assert "the disk holding the KV caches is full: removed the cache files of session" in log
        assert "stays in memory only" not in log and "could not write" not in log
        assert sids[-1] in on_disk and sids[0] not in on_disk
        assert status["tiers"]["disk"]["evicted_full"] >= 1
    finally:
        subprocess.run(["umount", str(cache)], check=True)


@pytest.mark.skipif(os.getuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_data_disk_is_disk_full_one_log_line_and_no_traceback(tmp_path: Path) -> None:
    """The whole data directory on a 30 MiB tmpfs, filled: requests get `disk_full` (a retry too, never
    `busy`), nothing acknowledged is lost, and stderr holds no traceback, only one line about the log file."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m,mode=0700", "tmpfs", str(data)], check=True)
    try:
        d = DaemonProcess(data)
        try:
            with d.client() as c:
                sid = c.request("session.create")["session"]["id"]
                _, done = c.chat(sid, "hello", max_tokens=4, temperature=0)
                assert done["type"] == "chat.done", done
                kept = c.request("session.get", session=sid)["messages"]
                with open(data / "filler", "wb") as filler:  # the disk fills up
                    try:
                        while True:
                            filler.write(b"\0" * (1 << 20))
                            filler.flush()
                    except OSError as e:
                        assert e.errno == errno.ENOSPC
                with open(data / "kvd.log", "ab", buffering=0) as log_file:  # and its log file's last page
                    with pytest.raises(OSError) as full:
                        while True:
                            log_file.write(b"\n")
                    assert full.value.errno == errno.ENOSPC
                for _ in range(3):
                    _, refused = c.chat(sid, "a message that does not fit " * 200, max_tokens=4)
                    assert (refused["type"], refused.get("code")) == ("error", "disk_full"), refused
                (data / "filler").unlink()
                assert c.request("session.get", session=sid)["messages"] == kept
                _, done = c.chat(sid, "and now?", max_tokens=4, temperature=0)
                assert done["type"] == "chat.done", done
        finally:
            assert d.terminate() == 0
        log = "".join(d.log)
        assert "Traceback" not in log and "Logging error" not in log, log
        assert log.count("is not being written") == 1, log
    finally:
        subprocess.run(["umount", str(data)], check=True)
