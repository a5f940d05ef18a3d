"""Which API sessions are branches of one conversation (a retry, an edited message, or a session the same
client named its conversation for): the session list shows each conversation once (kvchat's list,
`session.list`'s `branch_of`)."""

from __future__ import annotations

from typing import Any

from sqlite_utils import Database

from common import origins

# An assistant message kvd wrote (not one a client sent along with its conversation): it has usage, a
# finish_reason, or did not complete.
_ANSWERED = "g.usage IS NOT NULL OR g.finish_reason IS NOT NULL OR g.status != 'complete'"


def branch_map(db: Database) -> dict[str, str]:
    """Each API session that branches an older one: its id -> the conversation's first session's id.

    An API client sends the whole conversation every time; a retry or an edited message does not
    extend the stored session, so placement starts a new one holding the request's conversation,
    and the list filled with look-alike rows (four "What is the capital of France?" of 14 messages
    each). A conversation is named by its first request: the messages its first session holds
    before kvd's first answer (assistant messages the client sent along are part of it). A later
    API session whose messages start with that request (same system prompt) is a branch of it.
    Messages compare by role, length and their first 500 characters (and tool calls).
    """
    rows = db.execute(f"""
        WITH cut AS (
            SELECT s.id AS sid, coalesce((SELECT min(g.idx) FROM messages g WHERE g.session_id = s.id
                AND g.role = 'assistant' AND ({_ANSWERED})), {2**62}) AS answered
            FROM sessions s WHERE s.origin LIKE 'api%')
        SELECT m.session_id, m.role, length(m.content), substr(m.content, 1, 500),
            coalesce(substr(m.tool_calls, 1, 500), '')
        FROM cut JOIN messages m ON m.session_id = cut.sid AND m.idx < cut.answered
        ORDER BY m.session_id, m.idx""").fetchall()
    firsts: dict[str, list[tuple[Any, ...]]] = {}
    for sid, *said in rows:
        firsts.setdefault(sid, []).append(tuple(said))
    order = db.execute("SELECT id, system FROM sessions WHERE origin LIKE 'api%' "
                            "ORDER BY created_at, rowid").fetchall()
    first_of: dict[tuple[Any, ...], str] = {}  # (system, its first request) -> the conversation's first session
    for sid, system in order:
        if firsts.get(sid):
            first_of.setdefault((system, *firsts[sid]), sid)
    lengths = sorted({len(key) - 1 for key in first_of})
    made = {sid: n for n, (sid, _) in enumerate(order)}
    out: dict[str, str] = {}
    for sid, system in order:
        said = firsts.get(sid, [])
        for n in lengths:
            if n > len(said):
                break
            found = first_of.get((system, *said[:n]))
            if found is not None and made[found] < made[sid]:  # a branch is younger than what it branches
                out[sid] = out.get(found, found)
                break
    return _by_client(db, out)


def _by_client(db: Database, out: dict[str, str]) -> dict[str, str]:
    """`out`, with the sessions one client named its conversation for (its origin says: a Claude Code session's
    title request and its conversation, each a session of its own) joined to that conversation's first."""
    first: dict[str, str] = {}  # origin -> the first session of that client's conversation (or what it branches)
    for sid, origin in db.execute("SELECT id, origin FROM sessions WHERE origin LIKE 'api (%conversation %' "
                                  "ORDER BY created_at, rowid").fetchall():
        if origins.conversation_of(origin) is None:
            continue
        head = first.setdefault(origin, out.get(sid, sid))
        if head != sid and sid not in out:
            out[sid] = head
    return {sid: _root(out, sid) for sid in out}


def _root(out: dict[str, str], sid: str) -> str:
    """The conversation's first session: what `sid` branches, and what that branches, to the end (a
    branch of a session the client's conversation joined to another is that other's too)."""
    seen = {sid}
    while (up := out.get(sid)) is not None and up not in seen:  # (each step goes to an older session)
        seen.add(up)
        sid = up
    return sid
