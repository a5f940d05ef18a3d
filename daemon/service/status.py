"""`kvd status`: ask a running daemon how its cache tiers are doing."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from websockets.exceptions import WebSocketException

import protocol as p
from protocol import TOKEN_FILE, api_url

from .control import read_daemon_file
from .logfile import tail


def human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def fetch_status(url: str, token: str, timeout: float = 10.0) -> dict[str, Any]:
    from websockets.sync.client import connect

    with connect(url, additional_headers={"Authorization": f"Bearer {token}"},
                 open_timeout=timeout, max_size=None) as ws:
        hello = json.loads(ws.recv(timeout=timeout))
        if hello.get("type") != p.HELLO:
            raise RuntimeError(f"unexpected greeting from {url}: {hello}")
        ws.send(json.dumps({"id": "status", "type": p.STATUS}))
        while True:
            reply: dict[str, Any] = json.loads(ws.recv(timeout=timeout))
            if reply.get("id") == "status":
                if reply.get("type") == p.ERROR:
                    raise RuntimeError(f"kvd at {url} refused status: {reply.get('message')}")
                return reply


def duration(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}d {h}h" if d else f"{h}h {m}m" if h else f"{m}m {s}s" if m else f"{s}s"


def render_status(status: dict[str, Any], console: Console, url: str | None = None) -> None:
    # The status request's own connection is not a client worth counting.
    others = max(0, status["connections"] - 1)
    if "pid" in status:
        console.print(f"pid {status['pid']} · {url or '?'} · up {duration(status['uptime'])} · "
                      f"log {status['log_file']}", soft_wrap=True)
        if url:
            token = Path(status["data_dir"]) / TOKEN_FILE if status.get("data_dir") else TOKEN_FILE
            console.print(f"OpenAI API at {api_url(url)} · API key: the token in {token}", soft_wrap=True)
            console.print(f"Anthropic API at {api_url(url).removesuffix('/v1')} · the same key", soft_wrap=True)
    console.print(f"{status['server']} · model {status['model']} · "
                  f"{'ready' if status['ready'] else 'loading'} · "
                  f"{others} client(s) connected · {status['generating']} generating"
                  f"{f' · {w} waiting' if (w := status.get('waiting')) else ''}", soft_wrap=True)
    for sid, turn in (status.get("answering") or {}).items():
        if turn["phase"] == "prefill":
            doing = f"reading its prompt, {turn['fed']}/{turn['prompt_tokens']} tokens"
        else:
            doing = f"answering, {turn['generated']} token(s) so far after a {turn['prompt_tokens']}-token prompt"
        on = f" · {m}" if (m := turn.get("model")) else ""
        console.print(f"  session {sid}: {doing}{on}", soft_wrap=True)
    if len(loaded := status.get("models") or []) > 1:
        console.print("models loaded: " + ", ".join(f"{m['model']} ({m['state']})" for m in loaded)
                      + " · kvd ps shows more", soft_wrap=True)
    if (memory := status.get("memory") or {}).get("limit"):
        console.print(f"memory: {human(memory['counted'])} of {human(memory['limit'])} (models.memory): "
                      f"weights {human(memory['weights'])}, caches {human(memory['counted'] - memory['weights'])}",
                      soft_wrap=True)
    if device := status.get("device"):
        console.print(device, soft_wrap=True)
    if blas := status.get("blas"):
        console.print(blas, soft_wrap=True)
    if (ranks := status.get("ranks") or {}).get("world_size", 1) > 1:
        console.print(f"the model split across {ranks['world_size']} ranks · tiers below are rank 0's share · "
                      f"{ranks.get('messages', 0)} lockstep message(s), {ranks.get('bytes', 0)} bytes "
                      "(docs/distributed.md)", soft_wrap=True)
    _render_tiers(status, console)
    _render_shared(status, console)
    disk = status.get("tiers", {}).get("disk") or {}
    if "blocks" in disk:
        console.print(f"disk blocks: {disk['blocks']} of {disk['block_tokens']} tokens, "
                      f"{human(disk['block_bytes'])}; shared by several sessions: "
                      f"{human(disk['shared_bytes'])}; saved by sharing: {human(disk['saved_bytes'])}")
    shared = status.get("tiers", {}).get("shared") or {}
    if shared.get("restores"):
        console.print(f"turns started from another session's prefix: {shared['restores']} "
                      f"({shared['tokens']} tokens not prefilled again)")
    if (points := checkpoints_line(status.get("tiers", {}).get("checkpoints") or {})) is not None:
        console.print(points, soft_wrap=True)
    pre = status.get("prefetched") or {}
    if pre.get("sessions"):
        console.print(f"prefetched into memory after start: {pre['sessions']} session(s) "
                      f"({pre['resident']} resident, {pre['warm']} warm), {human(pre['bytes'])}")


def checkpoints_line(points: dict[str, Any]) -> str | None:
    """What a model with recurrent or sliding-window layers keeps of its state: its cache's layers by kind, a
    checkpoint's bytes, and those held (None for a model whose caches can be cut anywhere: it keeps none)."""
    if not points.get("each_bytes"):
        return None
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(points.get("kinds", {}).items()))
    return (f"cache layers: {kinds} · checkpoints: {human(points['each_bytes'])} each at most, up to "
            f"{points['keep']} per session; {points['held']} held in {points['sessions']} session(s), "
            f"{human(points['bytes'])}; {points['restores']} rewind(s) restored one")


TRAFFIC_MIN_WIDTH = 78  # narrower, the tiers' table leaves out its traffic columns rather than cut numbers


def _render_tiers(status: dict[str, Any], console: Console) -> None:
    """The tiers' table: sessions, bytes against budgets, traffic; running caches share resident's budget.
    A narrow terminal gets the first four columns whole (kvchat's list drops columns the same way)."""
    table = Table(show_edge=False)
    traffic = console.width >= TRAFFIC_MIN_WIDTH
    columns = ("tier", "sessions", "bytes", "budget", *(("hits", "misses", "page-ins", "page-outs") if traffic else ()))
    for col in columns:
        table.add_column(col, justify="left" if col == "tier" else "right", no_wrap=True)
    running = status.get("tiers", {}).get("running")
    if running is not None:
        # Running caches count against the resident budget: what the admitted turns' caches may
        # reach (prompt plus max_tokens), beside the idle resident caches.
        table.add_row("running", str(status.get("generating", 0)), human(running["bytes"]),
                      f"{human(running['budget'])}*", *([""] * (len(columns) - 4)))
    for name in p.TIERS:
        t = status.get("tiers", {}).get(name)
        if t is None:
            continue
        budget = human(t["budget"]) + ("*" if name == "resident" and running is not None else "")
        table.add_row(name, str(t["sessions"]), human(t["bytes"]), budget,
                      *((str(t["hits"]), str(t["misses"]), str(t["page_ins"]), str(t["page_outs"]))
                        if traffic else ()))
    console.print(table)
    if not traffic:
        console.print("(hits, misses, page-ins and page-outs: in a terminal at least "
                      f"{TRAFFIC_MIN_WIDTH} columns wide, or kvd status --json)")
    if running is not None:
        console.print(f"* one budget: running and resident caches together stay within "
                      f"{human(running['budget'])} (cache.resident_bytes); running counts what each "
                      "admitted turn's cache may reach, its prompt plus max_tokens", soft_wrap=True)


def _render_shared(status: dict[str, Any], console: Console) -> None:
    """Where caches of several models are held: the budgets they share, and each model's bytes in each."""
    shared = dict(status.get("budgets") or {})
    disk = status.get("tiers", {}).get("disk") or {}
    if disk.get("by_model"):
        shared["disk"] = {"budget": disk["budget"], "bytes": disk["bytes"], "by_model": disk["by_model"]}
    if len({m for t in shared.values() for m, n in t.get("by_model", {}).items() if n}) < 2:
        return
    console.print(f"the rows above are {status['model']}'s but for disk's bytes; every model's caches share "
                  "one budget per tier:", soft_wrap=True)
    for tier, t in shared.items():
        each = ", ".join(f"{m} {human(n)}" for m, n in sorted(t.get("by_model", {}).items()))
        console.print(f"  {tier}: {human(t['bytes'])} of {human(t['budget'])} ({each})", soft_wrap=True)


LAST_LINES = 10  # of the log, shown when the daemon is not there


def gone(data_dir: Path, why: str) -> int:
    """Not running: say so, and show how the last run ended (the end of its log)."""
    print(f"kvd status: {why} (start it with: kvd serve --data-dir {data_dir})", file=sys.stderr)
    log_file = Path(read_daemon_file(data_dir).get("log_file") or data_dir / "kvd.log")
    if log_file.exists():
        print(f"kvd status: the last lines of {log_file}:", file=sys.stderr)
        sys.stderr.writelines("  " + line for line in tail(log_file, LAST_LINES))
    return 1


def main(data_dir: Path, url: str | None, as_json: bool) -> int:
    info = read_daemon_file(data_dir)
    pid = info.get("pid")
    if url is None and isinstance(pid, int) and not _alive(pid):
        return gone(data_dir, f"kvd is not running: its pid {pid} (from {data_dir / p.DAEMON_FILE}) is gone")
    given = url is not None
    url = url or p.read_daemon_url(data_dir)
    if url is None:
        return gone(data_dir, f"no running daemon found in {data_dir}")
    try:
        token = (data_dir / p.TOKEN_FILE).read_text().strip()
        status = fetch_status(url, token)
    except OSError as e:
        if given:  # a URL the user typed: the data directory's daemon and its log are another story
            print(f"kvd status: {p.nothing_answers(url, data_dir)} ({e})", file=sys.stderr)
            return 1
        return gone(data_dir, f"cannot reach kvd at {url}: {e}")
    except (RuntimeError, WebSocketException) as e:
        print(f"kvd status: {e}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(status, indent=2))
    else:
        render_status(status, Console(width=status_width(Console())), url)
    return 0


def status_width(console: Console) -> int:
    """The terminal's width: a table wider than the terminal was broken mid-word by it (at 60 columns).
    Not a terminal (a pipe, a file): 100 columns at least, so no cell is squeezed for a reader with room."""
    return console.width if console.is_terminal else max(console.width, 100)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True
