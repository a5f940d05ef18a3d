"""The disk tier's index: which blocks and segment files exist, for which tokens.

Two kinds of file (store.py says why): content-addressed *blocks*, each stored once under ``blocks/`` and
listed in any number of sessions' *chains*, and each session's private *segments* under ``segments/<key>/``
(what follows its last whole block). A block's reference count is the number of chains that list it; a block
no chain lists is deleted (`collect`).

Its own SQLite file (cachestore owns these rows and no others), used only from the engine thread. A segment
file is listed here only after it is complete on disk (written, fsynced, renamed, directory fsynced), so a row
never points at a partial file; files without a row are leftovers of a crash and are deleted on open.

The index is not the only record, though: each segment's header holds its range, fingerprint and token ids. An
index that is missing, empty or not a database is therefore set aside (`lost` says how it was found) and
rebuilt from the files by the owner (store.py), not taken as "no segments".
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlite_utils import Database

from common.diskfull import is_disk_full
from common.tokenids import pack_tokens, unpack_tokens

from .blocks import BLOCK_RE
from .layout import BLOCKS, INDEX, SEGMENTS
from .migrations import known, migrate
from .rows import BlockRow, DiskNews, SegmentRow

log = logging.getLogger("kvd.cache")

KEY_RE = re.compile(r"[0-9a-f]{1,64}")
SEGMENT_SUFFIX = ".safetensors"


def check_key(key: str) -> str:
    """Keys become directory names: only short lowercase hex ever touches a path."""
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise ValueError(f"invalid cache key {key!r}")
    return key


class SegmentIndex:
    """The disk index, through one connection, for one model (`model`: its fingerprint).

    A session's private segments, chain and place in the LRU are kept per
    model: `chain`, `blocks_of`, `set_chain`, `touch`, `drop_from` and the rest
    see the rows of `model` only (None: of every model; tools and tests),
    and another model's rows are never loaded and never dropped for being
    another's. Bytes and the LRU order (`total_bytes`, `by_use`) span every
    model: one disk budget evicts across all of them.
    """

    def __init__(self, root: Path, model: str | None = None):
        self.root = root
        self.model = model
        self.files = root / SEGMENTS
        self.files.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.blocks = root / BLOCKS
        self.blocks.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = root / INDEX
        # How the index was found, when it could not be used as it was: None (fine),
        # "missing", "empty", or "damaged (<why>), set aside as <name>".
        self.lost: str | None = None
        self._changed: set[tuple[str, str | None]] = set()  # (session, model) a write changed, since `news`
        self._changed_blocks: set[str] = set()
        try:
            self.db = self._open()
        except sqlite3.DatabaseError as e:
            aside = self.path.with_name(f"index.sqlite.damaged-{int(time.time())}")
            self.path.replace(aside)
            for suffix in ("-wal", "-shm"):
                self.path.with_name(self.path.name + suffix).unlink(missing_ok=True)
            self.lost = f"damaged ({e}), set aside as {aside.name}"
            self.db = self._open()

    def _open(self) -> sqlite3.Connection:
        existed = self.path.exists()
        db = sqlite3.connect(self.path, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            wrapped = Database(db, execute_plugins=False)
            if not known(wrapped) and self.lost is None:
                self.lost = "empty" if existed else "missing"
            migrate(wrapped)
        except BaseException:
            db.close()
            raise
        return db

    def close(self) -> None:
        self.db.close()

    def dir_for(self, key: str) -> Path:
        return self.files / check_key(key)

    def path_for(self, key: str, fingerprint: str, start: int, end: int, after: str | None = None) -> Path:
        """A private segment's file, in a directory per session and model; `after` names the chain's
        last block when it has one, so a rebuilt index can find the session's chain again from the
        file names. (Files written before caches were kept per model sit in the session's directory.)"""
        tail = f"-{_check_block(after)}" if after else ""
        return self.dir_for(key) / model_dir(fingerprint) / f"{start:010d}-{end:010d}{tail}{SEGMENT_SUFFIX}"

    def _mine(self, model: str | None = None, column: str = "fingerprint") -> tuple[str, list[str]]:
        """The SQL condition (and its parameter) for rows of `model`, by default this index's; none: all."""
        m = model if model is not None else self.model
        return (f" AND {column} = ?", [m]) if m is not None else ("", [])

    def block_path(self, block: str, parent: str) -> Path:
        return self.blocks / f"{_check_block(block)}-{_check_parent(parent)}{SEGMENT_SUFFIX}"

    # --- reads ---

    def chain(self, key: str, model: str | None = None) -> list[SegmentRow]:
        """The session's private segments, in order."""
        mine, m = self._mine(model)
        rows = self.db.execute(
            'SELECT key, start, "end", file, nbytes, checksum, fingerprint, tokens FROM segments '
            f"WHERE key = ?{mine} ORDER BY start", [check_key(key), *m]).fetchall()
        return [self._segment_row(r) for r in rows]

    def _segment_row(self, r: tuple[Any, ...]) -> SegmentRow:
        return SegmentRow(r[0], start=r[1], end=r[2], path=self.files / r[3], nbytes=r[4], checksum=r[5],
                          fingerprint=r[6], tokens=tuple(unpack_tokens(r[7])))

    _BLOCK_COLUMNS = 'b.block, b.parent, b.start, b."end", b.file, b.nbytes, b.checksum, b.fingerprint, b.tokens'

    def _block_row(self, r: tuple[object, ...]) -> BlockRow:
        return BlockRow(str(r[0]), str(r[1]), start=int(r[2]), end=int(r[3]),  # type: ignore[call-overload]
                        path=self.blocks / str(r[4]), nbytes=int(r[5]),  # type: ignore[call-overload]
                        checksum=str(r[6]), fingerprint=str(r[7]), tokens=tuple(unpack_tokens(r[8])))  # type: ignore[arg-type]

    def blocks_of(self, key: str, model: str | None = None) -> list[BlockRow]:
        """The blocks the session's chain lists, in order."""
        mine, m = self._mine(model, "c.fingerprint")
        rows = self.db.execute(
            f"SELECT {self._BLOCK_COLUMNS} FROM chains c JOIN blocks b ON b.block = c.block "
            f"WHERE c.key = ?{mine} ORDER BY c.n", [check_key(key), *m]).fetchall()
        return [self._block_row(r) for r in rows]

    def find_blocks(self, blocks: Sequence[str]) -> dict[str, BlockRow]:
        """The listed blocks among `blocks`, by key."""
        found: dict[str, BlockRow] = {}
        for i in range(0, len(blocks), 500):
            part = list(blocks[i:i + 500])
            rows = self.db.execute(f"SELECT {self._BLOCK_COLUMNS} FROM blocks b WHERE b.block IN "
                                   f"({','.join('?' * len(part))})", part).fetchall()
            found.update((str(r[0]), self._block_row(r)) for r in rows)
        return found

    def children(self, parent: str) -> list[BlockRow]:
        """The blocks that follow the block `parent` (or the root) in some chain."""
        rows = self.db.execute(f"SELECT {self._BLOCK_COLUMNS} FROM blocks b WHERE b.parent = ?",
                               [parent]).fetchall()
        return [self._block_row(r) for r in rows]

    def by_use(self) -> list[tuple[str, str, int]]:
        """(key, model, bytes its private segments and its chain's blocks take) of every model's
        sessions, least recently used first: the order the disk budget evicts in."""
        return [(r[0], r[1], r[2] + r[3]) for r in self.db.execute(
            "SELECT k.key, k.fingerprint, (SELECT COALESCE(SUM(s.nbytes), 0) FROM segments s "
            "WHERE s.key = k.key AND s.fingerprint = k.fingerprint), (SELECT COALESCE(SUM(b.nbytes), 0) "
            "FROM chains c JOIN blocks b ON b.block = c.block WHERE c.key = k.key AND c.fingerprint = "
            "k.fingerprint) FROM keys k ORDER BY k.last_used, k.key, k.fingerprint")]

    def keys_by_use(self) -> list[tuple[str, int]]:
        """(key, bytes) of this index's model's sessions, least recently used first."""
        return [(key, n) for key, model, n in self.by_use() if self.model is None or model == self.model]

    def models_of(self) -> dict[str, list[str]]:
        """Each session's cache held for other models than this index's: their names (their
        fingerprints where no name was recorded), most recently used first."""
        held: dict[str, list[str]] = {}
        for key, name in self.db.execute(
                "SELECT k.key, COALESCE(m.name, k.fingerprint) FROM keys k LEFT JOIN models m "
                "ON m.fingerprint = k.fingerprint WHERE k.fingerprint != ? ORDER BY k.last_used DESC",
                [self.model or ""]):
            held.setdefault(key, []).append(name)
        return held

    def name_model(self, name: str) -> None:
        """Record this index's model's name (what `models_of` says)."""
        if self.model is not None:
            self.db.execute("INSERT OR REPLACE INTO models (fingerprint, name) VALUES (?, ?)", [self.model, name])

    def keys(self) -> set[str]:
        """Every key with at least one segment or block (of this index's model)."""
        mine, m = self._mine()
        return {r[0] for r in self.db.execute(f"SELECT key FROM segments WHERE 1{mine} UNION "
                                              f"SELECT key FROM chains WHERE 1{mine}", [*m, *m])}

    def total_bytes(self) -> int:
        """Bytes on disk: every block once, however many chains list it, plus every segment."""
        return int(self.db.execute(
            "SELECT (SELECT COALESCE(SUM(nbytes), 0) FROM segments) + "
            "(SELECT COALESCE(SUM(nbytes), 0) FROM blocks)").fetchone()[0])

    def bytes_by_model(self) -> dict[str, int]:
        """`total_bytes` by the model that wrote them: its name where one was recorded, else its fingerprint."""
        return {str(name): int(n) for name, n in self.db.execute(
            "SELECT COALESCE(m.name, f.fingerprint), SUM(f.nbytes) FROM (SELECT fingerprint, nbytes FROM segments "
            "UNION ALL SELECT fingerprint, nbytes FROM blocks) f LEFT JOIN models m ON m.fingerprint = f.fingerprint "
            "GROUP BY 1")}

    def count(self) -> tuple[int, int]:
        """(keys with segments or blocks, segments), of this index's model."""
        mine, m = self._mine()
        return len(self.keys()), int(self.db.execute(f"SELECT COUNT(*) FROM segments WHERE 1{mine}", m).fetchone()[0])

    def sharing(self) -> dict[str, int]:
        """Blocks, their bytes, those listed by more than one chain, and what sharing saves."""
        row = self.db.execute(
            "SELECT COUNT(*), COALESCE(SUM(nbytes), 0), COALESCE(SUM(CASE WHEN refs > 1 THEN nbytes END), 0), "
            "COALESCE(SUM((refs - 1) * nbytes), 0) FROM (SELECT b.nbytes AS nbytes, "
            "(SELECT COUNT(*) FROM chains c WHERE c.block = b.block) AS refs FROM blocks b)").fetchone()
        return {"blocks": int(row[0]), "block_bytes": int(row[1]), "shared_bytes": int(row[2]),
                "saved_bytes": int(row[3])}

    def load_all(self) -> tuple[list[tuple[str, str, int, int, str, int, str, str, bytes]], dict[str, list[str]],
                                dict[str, list[SegmentRow]]]:
        """Every block (block, parent, start, end, file name, nbytes, checksum, fingerprint, packed ids),
        chain and segment of this index's model: what the block table loads at start (raw, for
        speed: 100,000 blocks)."""
        mine, m = self._mine()
        blocks = self.db.execute(f"SELECT {self._BLOCK_COLUMNS} FROM blocks b WHERE 1{mine}", m).fetchall()
        chains: dict[str, list[str]] = {}
        for key, block in self.db.execute(f"SELECT key, block FROM chains WHERE 1{mine} ORDER BY key, n", m):
            chains.setdefault(key, []).append(block)
        segments: dict[str, list[SegmentRow]] = {}
        for r in self.db.execute('SELECT key, start, "end", file, nbytes, checksum, fingerprint, tokens '
                                 f"FROM segments WHERE 1{mine} ORDER BY key, start", m):
            segments.setdefault(r[0], []).append(self._segment_row(r))
        return blocks, chains, segments

    def news(self) -> DiskNews:
        """The rows of what changed since the last call, as they are now."""
        keys, blocks = self._changed, self._changed_blocks
        self._changed, self._changed_blocks = set(), set()
        found = self.find_blocks(sorted(blocks)) if blocks else {}
        mine = {key for key, model in keys if self.model is None or model == self.model}
        return DiskNews({key: ([b.block for b in self.blocks_of(key)], self.chain(key)) for key in mine},
                        {b: row for b in blocks if (row := found.get(b)) is None or self.model is None
                         or row.fingerprint == self.model},
                        frozenset(key for key, model in keys if self.model is not None and model != self.model))

    # --- writes ---

    def add(self, key: str, start: int, end: int, path: Path, nbytes: int, checksum: str,
            fingerprint: str, tokens: Sequence[int], now: float) -> None:
        """List a complete private segment. Called only after the file is durable."""
        if len(tokens) != end - start:
            raise ValueError("a segment's token ids must cover exactly [start, end)")
        rel = path.relative_to(self.files).as_posix()
        with self._transaction():
            self.db.execute(
                'INSERT OR REPLACE INTO segments (key, start, "end", file, nbytes, checksum, fingerprint, '
                "tokens, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [check_key(key), start, end, rel, nbytes, checksum, fingerprint, pack_tokens(tokens), now])
            self._used(key, fingerprint, now)
        self._changed.add((key, fingerprint))

    def add_block(self, block: str, parent: str, start: int, end: int, path: Path, nbytes: int,
                  checksum: str, fingerprint: str, tokens: Sequence[int], now: float) -> None:
        """List a complete block file (no chain lists it yet). Called only after the file is durable."""
        if len(tokens) != end - start:
            raise ValueError("a block's token ids must cover exactly [start, end)")
        rel = path.relative_to(self.blocks).as_posix()
        with self._transaction():
            self.db.execute(
                'INSERT OR REPLACE INTO blocks (block, parent, start, "end", file, nbytes, checksum, '
                "fingerprint, tokens, last_used) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [_check_block(block), _check_parent(parent), start, end, rel, nbytes, checksum,
                 fingerprint, pack_tokens(tokens), now])
        self._changed_blocks.add(block)

    def set_chain(self, key: str, blocks: Sequence[str], now: float, model: str | None = None) -> int:
        """Make `blocks` the session's chain (for `model`, by default this index's, else its blocks');
        collect blocks nobody lists any more. Returns bytes freed."""
        if (m := model or self.model) is None and blocks:
            m = self.find_blocks(blocks[:1])[blocks[0]].fingerprint
        mine, ms = self._mine(m)
        with self._transaction():
            self.db.execute(f"DELETE FROM chains WHERE key = ?{mine}", [check_key(key), *ms])
            self.db.executemany("INSERT INTO chains (key, fingerprint, n, block) VALUES (?, ?, ?, ?)",
                                [(key, m, n, b) for n, b in enumerate(blocks)])
            self.db.executemany("UPDATE blocks SET last_used = ? WHERE block = ?", [(now, b) for b in blocks])
            if m is not None:
                self._used(key, m, now)
        self._changed.add((key, m))
        return self.collect()

    def touch(self, key: str, now: float) -> None:
        mine, m = self._mine()
        self.db.execute(f"UPDATE keys SET last_used = ? WHERE key = ?{mine}", [now, check_key(key), *m])
        self.db.execute("UPDATE blocks SET last_used = ? WHERE block IN "
                        f"(SELECT block FROM chains WHERE key = ?{mine})", [now, key, *m])

    def touch_blocks(self, blocks: Sequence[str], now: float) -> None:
        self.db.executemany("UPDATE blocks SET last_used = ? WHERE block = ?", [(now, b) for b in blocks])

    def drop_from(self, key: str, start: int, model: str | None = None) -> int:
        """Unlist and delete the session's segments (of `model`, by default this index's) starting at
        or after `start`; returns bytes freed.

        `start == 0` forgets the session's cache for that model altogether:
        its chain too, and every block no other chain lists.
        """
        rows = [r for r in self.chain(key, model) if r.start >= start]
        listed = [b.block for b in self.blocks_of(key, model)] if start == 0 else []
        mine, m = self._mine(model)
        self._changed.add((key, model or self.model))
        with self._transaction():
            self.db.execute(f"DELETE FROM segments WHERE key = ? AND start >= ?{mine}", [key, start, *m])
            if start == 0:
                self.db.execute(f"DELETE FROM keys WHERE key = ?{mine}", [key, *m])
                self.db.execute(f"DELETE FROM chains WHERE key = ?{mine}", [key, *m])
        for r in rows:  # unlisted first, then deleted: a crash in between leaves only orphans
            r.path.unlink(missing_ok=True)
        freed = sum(r.nbytes for r in rows)
        if start == 0:
            for d in sorted({r.path.parent for r in rows}, reverse=True) + [self.dir_for(key)]:
                with contextlib.suppress(OSError):
                    d.rmdir()  # the model's directory, then the session's once no model's is left
            freed += self.collect(among=listed)  # (another model's: only the blocks its chain listed)
        return freed

    def forget(self, key: str) -> int:
        """A deleted session: its cache for every model goes."""
        models = [r[0] for r in self.db.execute("SELECT fingerprint FROM keys WHERE key = ? UNION SELECT "
                                                "fingerprint FROM segments WHERE key = ?", [key, key])]
        return sum(self.drop_from(key, 0, model) for model in models or [self.model or ""])

    def drop_segments(self, key: str, start: int, model: str | None = None) -> int:
        """Unlist and delete the session's private segments from `start` on; its chain stays."""
        rows = [r for r in self.chain(key, model) if r.start >= start]
        mine, m = self._mine(model)
        self._changed.add((key, model or self.model))
        if rows:
            self.db.execute(f"DELETE FROM segments WHERE key = ? AND start >= ?{mine}", [key, start, *m])
        for r in rows:
            r.path.unlink(missing_ok=True)
        return sum(r.nbytes for r in rows)

    def drop_block(self, block: str) -> list[str]:
        """A bad block: cut every chain that lists it there (with the segments after it), remove it.

        Returns the sessions whose chains were cut; they prefill from there.
        """
        cut = self.db.execute("SELECT key, fingerprint, n FROM chains WHERE block = ?", [block]).fetchall()
        self._changed.update((key, model) for key, model, _ in cut)
        files = [r.path for key, model, _ in cut for r in self.chain(key, model)]
        with self._transaction():
            for key, model, n in cut:
                self.db.execute("DELETE FROM chains WHERE key = ? AND fingerprint = ? AND n >= ?", [key, model, n])
                self.db.execute("DELETE FROM segments WHERE key = ? AND fingerprint = ?", [key, model])
        for path in files:
            path.unlink(missing_ok=True)
        self.collect(also=[block])
        return [key for key, _, _ in cut]

    def collect(self, also: Sequence[str] = (), among: Sequence[str] | None = None) -> int:
        """Delete the blocks no chain lists (and `also`); returns bytes freed. Delete means delete. Only this
        index's model's (`among`: only those): another model's I/O worker lists a block before the chain that
        needs it, and one collected in between was deleted under that chain."""
        scope, args = (("fingerprint = ?", [self.model]) if among is None and self.model is not None else
                       (f"block IN ({','.join('?' * len(among))})", list(among)) if among is not None else ("1", []))
        rows = self.db.execute(
            f"SELECT block, file, nbytes FROM blocks WHERE (block NOT IN (SELECT block FROM chains) AND {scope}) "
            f"OR block IN ({','.join('?' * len(also))})", [*args, *also]).fetchall()
        if not rows:
            return 0
        with self._transaction():
            self.db.executemany("DELETE FROM blocks WHERE block = ?", [(r[0],) for r in rows])
        self._changed_blocks.update(str(r[0]) for r in rows)
        for _, rel, _ in rows:
            (self.blocks / rel).unlink(missing_ok=True)
        return sum(int(r[2]) for r in rows)

    def evict(self, key: str, model: str | None = None) -> int:
        """Free a full disk of `key`'s files: deleted first, unlisted after if the disk allows.

        The reverse of drop_from's order, because unlisting needs room in the
        index's WAL that only the deletion frees. A row left pointing at a
        deleted file is harmless: reading it finds the file missing and drops
        the row, and the next sweep removes it. Blocks another chain lists stay.
        """
        rows = self.chain(key, model)
        mine, m = self._mine(model, "c.fingerprint")
        only = self.db.execute(
            f"SELECT b.file, b.nbytes FROM chains c JOIN blocks b ON b.block = c.block WHERE c.key = ?{mine} "
            "AND (SELECT COUNT(*) FROM chains o WHERE o.block = c.block) = 1", [key, *m]).fetchall()
        for r in rows:
            r.path.unlink(missing_ok=True)
        for rel, _ in only:
            (self.blocks / rel).unlink(missing_ok=True)
        try:
            self.drop_from(key, 0, model)
        except sqlite3.OperationalError as e:
            if not is_disk_full(e):
                raise
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
        return sum(r.nbytes for r in rows) + sum(int(n) for _, n in only)

    def listed(self, table: str, column: str, value: str) -> bool:
        return self.db.execute(f"SELECT 1 FROM {table} WHERE {column} = ?", [value]).fetchone() is not None

    def _used(self, key: str, model: str, now: float) -> None:
        self.db.execute("INSERT INTO keys (key, fingerprint, last_used) VALUES (?, ?, ?) ON CONFLICT "
                        "(key, fingerprint) DO UPDATE SET last_used = excluded.last_used", [key, model, now])

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:  # a failed COMMIT (a full disk) has rolled back already
                self.db.execute("ROLLBACK")
            raise


def _check_block(block: str) -> str:
    if not isinstance(block, str) or not BLOCK_RE.fullmatch(block):
        raise ValueError(f"invalid block key {block!r}")
    return block


def _check_parent(parent: str) -> str:
    """A block's parent: another block's key, or (the first block) the root key (blocks.root_key)."""
    if not isinstance(parent, str) or not BLOCK_RE.fullmatch(parent):
        raise ValueError(f"invalid block parent {parent!r}")
    return parent


def model_dir(fingerprint: str) -> str:
    """The directory name of one model's private segments under a session's (any fingerprint, safe)."""
    return hashlib.blake2b(fingerprint.encode(), digest_size=8).hexdigest()
