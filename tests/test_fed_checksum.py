"""Fed ids carry a checksum (issue 35): one bit flipped in ``session_tokens`` is caught where the ids are
read, the session's ids are rebuilt from its transcript, and the answer is a fresh prefill's."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
from sqlite_utils import Database

from common.tokenids import pack_tokens, unpack_tokens
from conftest import client, fed_tokens, greedy_reference, running_daemon
from daemon.prompt import conversation_ids, template_message
from sessions import DamagedFedIds, Store
from sessions.fedsum import fed_checksum
from sessions.migrations import MIGRATIONS

FIRST = "Tell me everything about caches. " * 3


def flip_bit_in_file(db_path: Path, blob: bytes, at: int) -> None:
    """Flip the lowest bit of byte `at` of `blob` where the database file holds it (WAL checkpointed)."""
    data = bytearray(db_path.read_bytes())
    where = data.find(blob)
    assert where >= 0 and data.find(blob, where + 1) < 0, "the ids are not in the file once"
    data[where + at] ^= 0x01
    db_path.write_bytes(bytes(data))


@pytest.mark.anyio
async def test_a_flipped_bit_in_the_fed_ids_gives_a_fresh_prefills_answer(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = (await c.request("session.create", system="Be brief."))["session"]["id"]
            await c.chat(sid, FIRST, max_tokens=16, temperature=0)
            await c.chat(sid, "And then?", max_tokens=16, temperature=0)
    db_path = tmp_path / "kvd.sqlite"
    stored = fed_tokens(db_path, sid)
    # Closing the store checkpointed the WAL: the row is in the main file, as the red team found it.
    flip_bit_in_file(db_path, pack_tokens(stored), 4 * (len(stored) // 3))
    with sqlite3.connect(db_path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)  # SQLite itself sees nothing
    assert fed_tokens(db_path, sid) != stored

    caplog.set_level(logging.WARNING, logger="kvd.turns")  # daemon/transcripts.py logs there
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            _, done = await c.chat(sid, "Go on.", max_tokens=16, temperature=0)
    assert done["type"] == "chat.done", done
    rebuilt = [r.getMessage() for r in caplog.records if "fail their checksum" in r.getMessage()]
    assert rebuilt == [f"session {sid}: its fed token ids fail their checksum; rebuilding them from the transcript"]

    from mlx_lm.utils import load

    model_dir = tmp_path / "models" / "tiny"
    tokenizer = load(str(model_dir))[1]
    with Store(db_path) as store:
        messages = store.messages(sid)
        fed, _ = store.fed(sid)  # verifies again: the rebuilt row carries a good sum
        system = store.get_session(sid)["system"]  # type: ignore[index]
    transcript = [template_message(m) for m in messages[:-1]]
    fresh = conversation_ids(tokenizer, transcript, system)
    u = done["usage"]
    assert u["prompt_tokens"] == len(fresh) and fed[:len(fresh)] == fresh
    assert fed[len(fresh):] == greedy_reference(model_dir, fresh, u["completion_tokens"])


def test_the_store_refuses_ids_that_fail_their_sum_and_drops_them(tmp_path: Path) -> None:
    with Store(tmp_path / "s.sqlite") as store:
        sid = store.create_session(title="t")["id"]
        store.append_message(sid, "user", "hi")
        store.set_tokens(sid, list(range(50)), covers=1)
        assert store.fed(sid) == (list(range(50)), 1)
        for column, value in (("tokens", pack_tokens([*range(49), 48])), ("covers", 0), ("checksum", 7)):
            store.set_tokens(sid, list(range(50)), covers=1)
            store.db.execute(f"UPDATE session_tokens SET {column} = ? WHERE session_id = ?", [value, sid])
            with pytest.raises(DamagedFedIds, match=f"session {sid}: its fed token ids fail their checksum"):
                store.fed(sid)
        other = store.create_session(title="t")["id"]  # a row copied onto another session fails too
        store.db.execute("INSERT INTO session_tokens SELECT ?, tokens, covers, updated_at, checksum, model "
                         "FROM session_tokens WHERE session_id = ?", [other, sid])
        with pytest.raises(DamagedFedIds):
            store.fed(other)
        store.drop_fed(sid)
        assert store.fed(sid) == ([], 0)


def test_the_migration_sums_rows_written_before_it(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    db = Database(path)
    MIGRATIONS.apply(db, stop_before="m007_fed_ids_checksum")  # the schema before the checksum
    db.execute("INSERT INTO sessions (id, title, created_at, updated_at) VALUES ('s1', '', 0, 0)")
    db.execute("INSERT INTO session_tokens (session_id, tokens, covers, updated_at) VALUES ('s1', ?, 2, 0)",
               [pack_tokens([5, 6, 7])])
    db.conn.commit()
    db.close()
    with Store(path) as store:
        assert store.fed("s1") == ([5, 6, 7], 2)
        (checksum,) = store.db.execute("SELECT checksum FROM session_tokens").fetchone()
    assert checksum == fed_checksum("s1", pack_tokens([5, 6, 7]), 2)
    assert unpack_tokens(pack_tokens([5, 6, 7])) == [5, 6, 7]
