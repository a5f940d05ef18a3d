"""Fed ids per model: whose tokens a session's fed ids are, and other models' ids put aside.

A session's fed ids (Store.fed) are one model's tokens. When a session moves
to another model, the turn core puts them aside here, under that model, and
takes the new model's own from before, if any: a switch back then appends to
exactly the ids that model fed, so the cache it kept matches to the last
token (an answer's generated ids need not be what tokenizing its text gives,
and a sliding window past its size cannot be rewound to where they differ).
Each row is checked as the fed ids are (sessions/fedsum.py); a damaged one is
dropped (that model then renders the transcript afresh).
"""

from __future__ import annotations

from collections.abc import Sequence

from common.tokenids import pack_tokens, unpack_tokens

from .fedsum import fed_checksum
from .store import Store

__all__ = ["drop_stash", "fed_model", "stash", "stashed", "unstash"]


def fed_model(store: Store, session_id: str) -> str | None:
    """The model whose tokens the session's fed ids are (None: not recorded, ids from before)."""
    row = store.db.execute("SELECT model FROM session_tokens WHERE session_id = ?", [session_id]).fetchone()
    return None if row is None else row[0]


def stashed(store: Store, session_id: str) -> dict[str, tuple[list[int], int]]:
    """Other models' fed ids of the session and what each covered, by model (damaged rows dropped)."""
    kept: dict[str, tuple[list[int], int]] = {}
    for model, blob, covers, checksum in store.db.execute(
            "SELECT model, tokens, covers, checksum FROM session_stash WHERE session_id = ?", [session_id]):
        blob = bytes(blob)
        if checksum == fed_checksum(session_id, blob, int(covers)) and not len(blob) % 4:
            kept[model] = (unpack_tokens(blob), int(covers))
        else:
            unstash(store, session_id, model)
    return kept


def stash(store: Store, session_id: str, model: str, tokens: Sequence[int], covers: int) -> None:
    """Put `model`'s fed ids of the session aside."""
    blob = pack_tokens(tokens)
    with store.db.atomic():
        store.db.execute("INSERT OR REPLACE INTO session_stash (session_id, model, tokens, covers, checksum) "
                         "VALUES (?, ?, ?, ?, ?)", [session_id, model, blob, covers,
                                                    fed_checksum(session_id, blob, covers)])


def unstash(store: Store, session_id: str, model: str) -> None:
    store.db.execute("DELETE FROM session_stash WHERE session_id = ? AND model = ?", [session_id, model])


def drop_stash(store: Store, session_id: str) -> None:
    """Forget every other model's ids (the transcript was cut or its system prompt changed under them)."""
    store.db.execute("DELETE FROM session_stash WHERE session_id = ?", [session_id])
