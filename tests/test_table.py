"""The block table (issue 22) with plain objects: chains hashed once, one walk, references, the disk mirror."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import cachestore.table as table_module
from cachestore.blocks import block_key, block_keys, root_key
from cachestore.rows import BlockRow, DiskNews, SegmentRow
from cachestore.table import BlockTable

ROOT = root_key("fp")
B = 4


def row(tokens: list[int], k: int, nbytes: int = 100) -> BlockRow:
    keys = block_keys(tokens, B, ROOT)
    return BlockRow(keys[k], keys[k - 1] if k else ROOT, start=k * B, end=(k + 1) * B, path=Path(f"/b/{k}"),
                    nbytes=nbytes, checksum="0", fingerprint="fp", tokens=tuple(tokens[k * B:(k + 1) * B]))


def seg(key: str, start: int, tokens: list[int]) -> SegmentRow:
    return SegmentRow(key, start=start, end=len(tokens), path=Path(f"/s/{key}"), nbytes=10, checksum="0",
                      fingerprint="fp", tokens=tuple(tokens[start:]))


def test_a_chain_is_hashed_once_and_extended(monkeypatch: pytest.MonkeyPatch) -> None:
    t = BlockTable(ROOT, B)
    calls: list[int] = []

    def counted(parent: str, ids: list[int]) -> str:
        calls.append(1)
        return block_key(parent, ids)

    monkeypatch.setattr(table_module, "block_key", counted)
    ids = list(range(10))
    assert t.keys_for("aaaa", ids) == block_keys(ids, B, ROOT) and len(calls) == 2
    assert t.keys_for("aaaa", ids + [10, 11, 12]) == block_keys(ids + [10, 11, 12], B, ROOT) and len(calls) == 3
    assert t.keys_for("aaaa", ids[:5] + [99] * 8) == block_keys(ids[:5] + [99] * 8, B, ROOT)  # a rewind
    assert len(calls) == 5  # the first block kept, the next two hashed


def test_the_walk_finds_each_tier_down_the_chain_and_what_follows() -> None:
    t = BlockTable(ROOT, B)
    a = list(range(13))
    t.attach("aaaa", a, block_keys(a[:12], B, ROOT))
    t.set_live("aaaa", True)
    b = a[:8] + [50, 51, 52, 53, 54]
    t.attach("bbbb", b, block_keys(b[:12], B, ROOT))
    t.blocks[block_keys(b, B, ROOT)[0]].warm = object()  # a warm copy of the first block only
    wanted = a[:8] + [50, 51, 60, 61, 62]
    w = t.walk(block_keys(wanted, B, ROOT))
    assert (w.live, w.live_from, w.warm, w.disk) == (2, "aaaa", 1, 0)
    children, followers = t.after(w.keys[1])
    assert sorted(c.tokens() for c in children) == [[8, 9, 10, 11], [50, 51, 52, 53]]
    assert followers == []
    assert [s.key for s in t.after(block_keys(a, B, ROOT)[2])[1]] == ["aaaa"]  # its tail follows its last block


def test_references_keep_blocks_and_the_last_one_drops_them() -> None:
    t = BlockTable(ROOT, B)
    a = list(range(9))
    keys = block_keys(a[:8], B, ROOT)
    t.attach("aaaa", a, keys)
    t.attach("bbbb", a[:8] + [7], keys)
    assert [t.blocks[k].refs for k in keys] == [2, 2]
    t.detach("aaaa")
    assert [t.blocks[k].refs for k in keys] == [1, 1]
    t.detach("bbbb")
    assert t.blocks == {} and t.children == {}


def test_the_disk_mirror_counts_each_block_once_and_follows_the_worker() -> None:
    t = BlockTable(ROOT, B)
    a = list(range(13))
    rows = [row(a, k) for k in range(3)]
    chain = [r.block for r in rows]
    t.load([(r.block, r.parent, r.start, r.end, r.path.name, r.nbytes, r.checksum, r.fingerprint, bytes(4 * B))
            for r in rows], {"aaaa": chain, "bbbb": chain[:2]},
           {"aaaa": [seg("aaaa", 12, a)], "bbbb": [seg("bbbb", 8, a[:9])]})
    assert t.sharing() == {"blocks": 3, "block_bytes": 300, "shared_bytes": 200, "saved_bytes": 200}
    assert (len(t.on_disk), t.disk_segments, t.disk_bytes) == (2, 2, 320)
    # The worker reports: bbbb forgotten on disk (its chain and segment gone), nothing else.
    t.apply(DiskNews({"bbbb": ([], [])}, {}))
    assert t.sharing()["shared_bytes"] == 0 and (len(t.on_disk), t.disk_bytes) == (1, 310)
    assert "bbbb" not in t.sessions
    # A bad block dropped: every chain listing it cut there, the block gone.
    t.apply(DiskNews({"aaaa": (chain[:1], [])}, {chain[1]: None, chain[2]: None}))
    assert t.sharing()["blocks"] == 1 and t.disk_bytes == 100 and set(t.blocks) == {chain[0]}
    blocks, tail = t.disk_rows("aaaa")
    assert [r.block for r in blocks] == chain[:1] and tail == []


def test_the_common_prefix_is_found_at_every_cut_across_the_compared_slices() -> None:
    from cachestore.prefix import common_prefix_len

    rng = random.Random(7)
    for n in (0, 1, 511, 512, 513, 1025, 3000):
        a = [rng.randrange(3) for _ in range(n)]
        for cut in sorted({0, 1, 511, 512, 513, n // 2, n - 1, n}):
            if not 0 <= cut <= n:
                continue
            b = a[:cut] + ([7] if cut < n else []) + a[cut + 1:]
            assert common_prefix_len(a, b) == cut
            assert common_prefix_len(b, a) == cut
            assert common_prefix_len(a, b[:cut]) == cut  # one is a prefix of the other
            assert common_prefix_len(tuple(a), tuple(b)) == cut
            assert common_prefix_len(a, tuple(b)) == cut  # mixed sequences compare id by id
