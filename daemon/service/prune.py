"""`kvd sessions prune`: delete the sessions nobody will go back to, through the running daemon.

A dry run unless `--yes`: it lists what it would delete first. The daemon does
the deleting (`session.delete`, one request each), so a session's cache goes
with its transcript and a session that is answering is refused, as from
kvchat; deleting behind a daemon's back would leave cache files that the next
start takes for lost transcripts.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import protocol as p
from common import origins
from common.printable import printable

DAY = 86400.0


def chosen(sessions: list[dict[str, Any]], *, empty: bool, older_than: float | None, origin: str,
           now: float) -> list[dict[str, Any]]:
    """Pure: the sessions the filters pick (all given filters must hold; at least one must be given)."""
    out = []
    for s in sessions:
        if empty and s.get("message_count"):
            continue
        if older_than is not None and now - float(s.get("updated_at") or now) < older_than * DAY:
            continue
        if not origins.matches(s.get("origin"), origin):
            continue
        out.append(s)
    return out


@contextmanager
def _connection(url: str, token: str, timeout: float = 30.0) -> Iterator[Any]:
    from websockets.sync.client import connect

    with connect(url, additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=timeout,
                 max_size=None) as ws:
        hello = json.loads(ws.recv(timeout=timeout))
        if not isinstance(hello, dict) or hello.get("type") != p.HELLO:
            raise _NotKvd(f"it greeted with {printable(str(hello))[:80]!r}, not kvd's hello")
        yield ws


class _NotKvd(Exception):
    """What answered at the daemon's URL does not speak kvd's protocol."""


def _request(ws: Any, rid: str, kind: str, **fields: Any) -> dict[str, Any]:
    ws.send(json.dumps({"id": rid, "type": kind, **fields}))
    while True:
        reply = json.loads(ws.recv(timeout=30.0))
        if not isinstance(reply, dict):
            raise _NotKvd(f"it answered {printable(str(reply))[:80]!r}, not a kvd reply")
        if reply.get("id") == rid:
            return reply


def main(data_dir: Path, *, empty: bool, older_than: float | None, origin: str, yes: bool) -> int:
    if not empty and older_than is None and origin == "any":
        print("kvd sessions prune: say which sessions: --empty, --older-than DAYS and/or --from ORIGIN "
              "(a dry run lists them; --yes deletes them)", file=sys.stderr)
        return 2
    url = p.read_daemon_url(data_dir)
    if url is None:
        print(f"kvd sessions prune: kvd is not running for {data_dir}; the daemon deletes sessions (their caches "
              f"go with them): start it with kvd serve --detach --data-dir {data_dir}", file=sys.stderr)
        return 1
    shown = printable(url)[:200]
    restart = (f"`kvd status --data-dir {data_dir}` says whether kvd runs there; if it does not, start it with "
               f"kvd serve --detach --data-dir {data_dir} (which rewrites {data_dir / p.DAEMON_FILE})")
    if not url.startswith(("ws://", "wss://")):
        print(f"kvd sessions prune: {data_dir / p.DAEMON_FILE} names {shown!r}, which is not kvd's websocket URL "
              f"(ws://HOST:PORT/v1); {restart}", file=sys.stderr)
        return 1
    from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI, WebSocketException
    from websockets.uri import parse_uri

    try:
        parse_uri(url)
    except (InvalidURI, ValueError):
        print(f"kvd sessions prune: {data_dir / p.DAEMON_FILE} names {shown!r}, which is not a URL kvd could "
              f"have written; {restart}", file=sys.stderr)
        return 1
    token_file = data_dir / p.TOKEN_FILE
    try:
        token = token_file.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        print(f"kvd sessions prune: cannot read kvd's token file {token_file} "
              f"({getattr(e, 'strerror', None) or e}); {restart}", file=sys.stderr)
        return 1
    try:
        with _connection(url, token) as ws:
            listed = _request(ws, "list", p.SESSION_LIST).get("sessions") or []
            picked = chosen(listed, empty=empty, older_than=older_than, origin=origin, now=time.time())
            for s in picked:
                made = origins.kind(s.get("origin"))
                print(f"{s['id']}  {made:8}  {s.get('message_count', 0):4} messages  {s.get('title')}")
            if not yes:
                print(f"{len(picked)} of {len(listed)} session(s) would be deleted; run again with --yes to "
                      "delete them", file=sys.stderr)
                return 0
            deleted = 0
            for s in picked:
                reply = _request(ws, f"delete-{s['id']}", p.SESSION_DELETE, session=s["id"])
                if reply.get("type") == p.ERROR:
                    print(f"kvd sessions prune: kept {s['id']}: {reply.get('message')}", file=sys.stderr)
                else:
                    deleted += 1
    except InvalidStatus as e:
        why = ("it refused kvd's token: the token file is not this daemon's" if e.response.status_code in (401, 403)
               else f"it answered HTTP {e.response.status_code}")
        print(f"kvd sessions prune: what listens at {shown} is not the kvd of {data_dir} ({why}); {restart}",
              file=sys.stderr)
        return 1
    except ConnectionClosed as e:
        print(f"kvd sessions prune: kvd at {shown} closed the connection ({printable(str(e))[:120]}); nothing "
              "more was deleted: run the same command again", file=sys.stderr)
        return 1
    except (WebSocketException, _NotKvd, ValueError, KeyError, TypeError) as e:
        # Anything else from the other end: an HTTP server that is not kvd, a reply that is not JSON.
        print(f"kvd sessions prune: what listens at {shown} does not speak kvd's protocol "
              f"({printable(str(e) or type(e).__name__)[:120]}); {restart}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"kvd sessions prune: cannot reach kvd at {shown} ({e.strerror or e}); {restart}", file=sys.stderr)
        return 1
    print(f"deleted {deleted} of {len(listed)} session(s)", file=sys.stderr)
    return 0 if deleted == len(picked) else 1
