"""The engine's plan and the worker's write agree (issue 22): a seeded property test.

The engine plans a turn's writes with `writeback.plan` on a *promise* (the
chain as it will be once the jobs queued before are done) and evaluates
only the spans the plan names; the worker's `Writeback.write_behind` then
makes the index hold the turn against the index as it is. They must agree:
the worker never needs a span the engine did not evaluate (`Stale`), and
once the queue is drained the index holds exactly what the last promise
said. Random sessions, token lists (rewinds, branches, shared blocks from a
small alphabet), block sizes, segment limits and flush points; writes of
jobs queued behind others are planned on the promises, as on the engine.

The files are real (empty: the worker's logic is under test, not the
format, which test_segments covers), the index is real SQLite.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

import cachestore.writeback as writeback
from cachestore.blocks import block_keys, root_key, whole_blocks
from cachestore.index import SegmentIndex
from cachestore.snapshot import Snapshot
from cachestore.writeback import Promise, Stale, Writeback, plan


class Written:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.nbytes = 10
        self.checksum = "0"


@pytest.fixture
def fake_files(monkeypatch: pytest.MonkeyPatch) -> None:
    def write_segment(path: Path, snap: Snapshot, *, fingerprint: str, tokens: Any) -> Written:
        path.write_bytes(b"")
        return Written(path)

    monkeypatch.setattr(writeback, "write_segment", write_segment)


class Recording(dict[tuple[int, int], Snapshot]):
    """The evaluated spans, recording which ones the worker used."""

    used: set[tuple[int, int]]

    def __getitem__(self, span: tuple[int, int]) -> Snapshot:
        self.used.add(span)
        return super().__getitem__(span)


def turn(rng: random.Random, held: list[int]) -> list[int]:
    """The next token list of a session: it grows, or rewinds (regenerate, edit) and grows, or branches."""
    alphabet = 3  # few ids: sessions' blocks coincide often (shared blocks, reuse)
    new = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 12))]
    how = rng.random()
    if how < 0.55 or not held:
        return held + new
    if how < 0.9:
        return held[:rng.randrange(len(held))] + new
    return new


@pytest.mark.parametrize("seed", range(8))
def test_plan_and_write_behind_agree(tmp_path: Path, fake_files: None, seed: int) -> None:
    rng = random.Random(seed)
    block = rng.choice([1, 2, 3, 4, 8])
    max_segments = rng.choice([1, 2, 3, 16])
    cut = rng.random() < 0.6  # a cache that can be cut into blocks (plain KV), or not (a window)
    bks_captured = rng.random() < 0.5  # a window: blocks captured at boundaries during prefill
    index = SegmentIndex(tmp_path)
    root = root_key("fp")
    writer = Writeback(lambda: index, fingerprint="fp", root=root, block=block, disk_bytes=1 << 40,
                       max_segments=max_segments, clock=lambda: 1.0)
    keys = ["aaaa", "bbbb", "cccc"]
    tokens: dict[str, list[int]] = {k: [] for k in keys}
    promised: dict[str, Promise] = {}
    queue: list[tuple[str, Recording, list[int], list[str], bool, list[int]]] = []

    def drain() -> None:
        for key, pieces, toks, bks, rewrite, splits in queue:
            try:
                writer.write_behind(key, pieces, toks, bks, rewrite=rewrite, splits=splits)
            except Stale as e:
                raise AssertionError(f"seed {seed}: the worker needed a span the plan did not give: {e}") from None
            tail = [span for span in pieces if span[0] >= len(bks) * block]
            assert set(tail) <= pieces.used, f"seed {seed}: the plan evaluated a tail the worker did not write"
            assert set(index.find_blocks(bks)) == set(bks)  # every block of the chain is on disk
        queue.clear()
        for key in keys:
            if key in promised:
                assert writer.promise(key) == promised.pop(key), f"seed {seed}: {key}"

    for _ in range(60):
        key = rng.choice(keys)
        toks = turn(rng, tokens[key])
        tokens[key] = toks
        held = promised.get(key) or writer.promise(key)
        rewrite = not cut and rng.random() < 0.5  # a window's snapshot: written whole or not at all
        bks = block_keys(toks[:whole_blocks(len(toks), block) * block], block, root) if cut else []
        if not cut and bks_captured:  # a window captured at some block boundaries: a prefix of them
            bks = block_keys(toks[:rng.randrange(whole_blocks(len(toks), block) + 1) * block], block, root)
        # A live cache that cannot be cut ends a segment at each checkpoint its turn passed (a prompt's end).
        splits = sorted({rng.randrange(1, len(toks)) for _ in range(rng.randrange(3))}) \
            if not cut and not rewrite and len(toks) > 1 else []
        blocks_from, private_from, after = plan(held, toks, whole=len(bks), block=block,
                                                max_segments=max_segments, rewrite=rewrite, splits=splits)
        pieces = Recording()
        pieces.used = set()
        if blocks_from is not None:
            for k in range(blocks_from, after.base, block):
                pieces[k, k + block] = Snapshot(k, k + block, ())
        if private_from is not None:
            ends = [e for e in after.ends if e > private_from]
            assert ends[-1] == len(toks) and len(after.ends) <= max_segments
            for a, b in zip([private_from, *ends], ends):
                pieces[a, b] = Snapshot(a, b, ())
        assert after.base == len(bks) * block
        promised[key] = after
        queue.append((key, pieces, toks, bks, rewrite, splits))
        if rng.random() < 0.4:
            drain()
    drain()
    index.close()
