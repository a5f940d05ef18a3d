"""An index on fed token ids, so a stateless request finds its session fast.

An OpenAI-style request carries the whole conversation; the daemon wants the
stored session whose fed ids are the longest prefix of the request's. Reading
every session's ids would cost a scan of all of them, so each session's ids
are cut into blocks of BLOCK tokens and the k-th block is keyed by a hash
chain over blocks 1..k: one key stands for the whole prefix up to it. A
lookup hashes the request the same way and asks SQLite, through an index,
which sessions share the deepest key; the caller then compares the true ids,
so a hash collision can cost a comparison, never a wrong match.

16 tokens a block: a chat template's head plus a short first message is a few
dozen tokens, so a block of hundreds would miss most short conversations;
an index row per 16 tokens is 4 KB of rows for a 4k-token session.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from protocol.tokenids import pack_tokens

BLOCK = 16


def block_keys(tokens: Sequence[int]) -> list[int]:
    """The chain key of every whole block of `tokens`, as signed 64-bit ints (SQLite's INTEGER)."""
    keys: list[int] = []
    previous = b""
    for end in range(BLOCK, len(tokens) + 1, BLOCK):
        digest = hashlib.blake2b(previous + pack_tokens(tokens[end - BLOCK:end]), digest_size=8).digest()
        keys.append(int.from_bytes(digest, "little", signed=True))
        previous = digest
    return keys
