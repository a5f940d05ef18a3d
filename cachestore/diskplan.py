"""Which files restore the longest prefix of a turn's ids from disk: planned on the engine thread, nothing read yet.

Either the session's own chain (its blocks, then its private segments) or
the blocks any session wrote whose keys are the wanted ids' own, as the
block table's walk found them (table.py): whichever holds more. A plain KV
cache can end anywhere inside its last file (the read cuts it where the ids
part); a cache that cannot be cut (a recurrent state, a sliding window)
holds its state at each file's end only, so its plan ends at the last file
the wanted ids agree with whole: a segment's or a block's end is its
checkpoint on disk (checkpoints.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.tokenids import pack_tokens

from .prefix import MIN_SHARED, common_prefix_len
from .rows import BlockRow, SegmentRow
from .table import BlockTable, Walk

DiskRow = BlockRow | SegmentRow


@dataclass
class DiskPlan:
    rows: list[DiskRow]
    end: int  # tokens the plan restores (the last piece is cut there if it ends later)
    own: int  # of those, the tokens the session's own chain holds
    chain: int = 0  # the tokens the session's own chain holds on disk in all (a restore that ends before: a rewind)


def plan_restore(table: BlockTable, fingerprint: str, key: str, wanted: Sequence[int], limit: int, walk: Walk,
                 *, cuts: bool = True) -> DiskPlan:
    """The files that restore the longest prefix of `wanted` (at most `limit` ids); `cuts`: the model's caches can
    be cut anywhere (else each file serves only whole)."""
    own = _own(table, fingerprint, key, wanted, limit, cuts)
    found, end = _shared(table, fingerprint, wanted, limit, walk, cuts)
    s = table.sessions.get(key)
    own.chain = (s.disk_tail[-1].end if s.disk_tail else len(s.disk_keys) * table.block) if s is not None else 0
    if end <= own.end:
        return own
    mine_blocks = len(set(s.disk_keys) & set(found)) if s is not None else 0
    rows: list[DiskRow] = [table.blocks[bk].row(table.blocks_dir) for bk in found]
    return DiskPlan(rows, end, min(mine_blocks * table.block, end), own.chain)


def _own(table: BlockTable, fingerprint: str, key: str, wanted: Sequence[int], limit: int, cuts: bool) -> DiskPlan:
    """The session's own chain, as far as the wanted ids agree with it."""
    mine: list[DiskRow] = []
    pos = 0
    s = table.sessions.get(key)
    for bk in s.disk_keys if s is not None else []:
        b = table.blocks[bk]
        assert b.disk is not None
        if b.start != pos or b.disk.fingerprint != fingerprint or (shared := b.agrees(wanted)) == 0:
            break
        upto = min(b.start + shared, limit)
        if upto < b.end and not cuts:
            break
        mine.append(b.row(table.blocks_dir))
        pos = upto
        if pos < b.end:
            break
    else:
        for row in s.disk_tail if s is not None else []:
            if row.start != pos or row.fingerprint != fingerprint:
                break
            shared = common_prefix_len(row.tokens, wanted[row.start:row.end])
            upto = min(row.start + shared, limit)
            if shared == 0 or (upto < row.end and not cuts):
                break
            mine.append(row)
            pos = upto
            if pos < row.end:
                break
    return DiskPlan(mine, pos, pos)


def _shared(table: BlockTable, fingerprint: str, wanted: Sequence[int], limit: int, walk: Walk,
            cuts: bool) -> tuple[list[str], int]:
    """The blocks any session wrote that hold the wanted ids, and how many ids they restore."""
    found: list[str] = []
    end = 0
    for bk in walk.keys[:walk.disk]:
        b = table.blocks[bk]
        assert b.disk is not None
        if b.disk.fingerprint != fingerprint or b.start != end or end >= limit \
                or b.ids != pack_tokens(wanted[b.start:b.end]) or (b.end > limit and not cuts):
            break
        found.append(bk)
        end = min(b.end, limit)
    if cuts and end < limit and end == len(found) * table.block:
        # Past the last whole block in common: the block some session wrote next that
        # agrees longest with the wanted ids, cut where they part (KV blocks cut anywhere).
        best, agree = None, 0
        for child in table.after(found[-1] if found else table.root)[0]:
            if child.disk is None or child.disk.fingerprint != fingerprint or child.start != end:
                continue
            n = min(child.agrees(wanted), limit - end)
            if n > agree:
                best, agree = child.key, n
        if best is not None and end + agree >= MIN_SHARED:  # a template's head alone: not worth a read
            found.append(best)
            end += agree
    return found, end
