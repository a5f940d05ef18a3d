"""Rebuild a lost cache index from the cache files' own headers.

Every file carries its range, fingerprint and token ids; a block's name is
its key and its parent's, and a session's private segment's name its
session (the directory) and the last block of its chain. So what verifies
here is exactly what the lost index listed, chains included, and no valid
cache is thrown away.
"""

from __future__ import annotations

import logging
import time

from .blocks import block_key, root_key
from .errors import CorruptSegment, UnsupportedFormat
from .index import SEGMENT_SUFFIX, SegmentIndex, check_key
from .segments import read_header

log = logging.getLogger("kvd.cache")


def rebuild_index(index: SegmentIndex, how: str) -> None:
    """List again every block and segment file whose own header verifies; remove the rest.

    Each file carries its range, fingerprint and token ids; a block's
    name is its key and its parent's (the key is checked against the
    ids), and a private segment's name its session (the directory) and
    the last block of its chain, from which the chain is walked back.
    What verifies is exactly what the lost index would have listed.
    """
    blocks = sorted(index.blocks.glob(f"*{SEGMENT_SUFFIX}"))
    files = sorted([*index.files.glob(f"*/*{SEGMENT_SUFFIX}"), *index.files.glob(f"*/*/*{SEGMENT_SUFFIX}")])
    if not files and not blocks:
        if how not in ("missing", "empty"):
            log.warning("the cache index %s was %s; there were no cache files to rebuild it from",
                        index.path, how)
        return
    dropped: list[str] = []
    parents: dict[str, tuple[str, int, int]] = {}  # block -> (parent, start, end)
    now = time.time()
    for path in blocks:
        try:
            block, _, parent = path.name[:-len(SEGMENT_SUFFIX)].partition("-")
            h = read_header(path)
            if path != index.block_path(block, parent) or block_key(parent, h.tokens) != block:
                raise UnsupportedFormat("its name is not the key of its token ids", path=path)
        except (CorruptSegment, ValueError) as e:
            dropped.append(str(e))
            path.unlink(missing_ok=True)
            continue
        index.add_block(block, parent, h.start, h.end, path, h.nbytes, h.checksum, h.fingerprint,
                             h.tokens, path.stat().st_mtime)
        parents[block] = (parent, h.start, h.end)
    kept: set[tuple[str, str]] = set()  # (session, model)
    count = 0
    for path in files:
        key = path.relative_to(index.files).parts[0]
        try:
            check_key(key)
            h = read_header(path)
            after = path.name[:-len(SEGMENT_SUFFIX)].split("-")[2:]
            named = index.path_for(key, h.fingerprint, h.start, h.end, after[0] if after else None)
            if path not in (named, named.parent.parent / named.name):  # (the second: before per-model caches)
                raise UnsupportedFormat(f"its name does not match its range [{h.start}, {h.end})", path=path)
            chain = _walk_back(root_key(h.fingerprint), after[0], parents) if after else []
            if (chain[-1][1] if chain else 0) != h.start and after:
                raise UnsupportedFormat("the blocks before it are gone", path=path)
        except (CorruptSegment, ValueError) as e:
            dropped.append(str(e))
            path.unlink(missing_ok=True)
            continue
        if (key, h.fingerprint) not in kept and chain:
            index.set_chain(key, [b for b, _ in chain], now, model=h.fingerprint)
        index.add(key, h.start, h.end, path, h.nbytes, h.checksum, h.fingerprint, h.tokens,
                       path.stat().st_mtime)
        kept.add((key, h.fingerprint))
        count += 1
    index.collect()
    log.warning("the cache index %s was %s; rebuilt it from the cache files' own headers: "
                "%d file(s) of %d session(s) and %d block(s) kept%s", index.path, how, count,
                len({key for key, _ in kept}), index.sharing()["blocks"],
                f", {len(dropped)} that did not verify removed (first: {dropped[0]})" if dropped else "")

def _walk_back(root: str, last: str, parents: dict[str, tuple[str, int, int]]) -> list[tuple[str, int]]:
    """The chain from the root to `last` through the rebuilt blocks, as [(block, end)]; ValueError if broken."""
    chain: list[tuple[str, int, int]] = []  # walked backwards: (block, start, end)
    at = last
    while at != root:
        if at not in parents or len(chain) > 1 << 20:
            raise ValueError(f"block {at} of the chain is missing")
        parent, start, end = parents[at]
        if chain and end != chain[-1][1]:
            raise ValueError(f"block {at} does not end where the next one starts")
        chain.append((at, start, end))
        at = parent
    if chain and chain[-1][1] != 0:
        raise ValueError(f"the chain of block {last} does not start at token 0")
    return [(block, end) for block, _, end in reversed(chain)]
