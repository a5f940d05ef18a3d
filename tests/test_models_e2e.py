"""Many models, one `kvd serve` process: restarts keep each model's caches, and `kvd ps` / `kvd models` show them.

A real daemon process on builtin:tiny, asked for builtin:tiny-swa by name.
Ten switches of one conversation back and forth lose no cache; after a
restart each conversation restores its own model's cache; `kvd ps` and `kvd
models` print every field they promise (the test fails if one goes missing).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from daemonproc import DaemonProcess, SyncClient

TINY, SWA = "builtin:tiny", "builtin:tiny-swa"
GREEDY = {"temperature": 0.0, "max_tokens": 6}
PS_FIELDS = {"model", "default", "state", "weights_bytes", "context_length", "idle_s", "unloads_in_s", "device",
             "cache"}


def say(c: SyncClient, session: str, text: str, **fields: Any) -> dict[str, Any]:
    _, done = c.chat(session, text, **GREEDY, **fields)
    assert done["type"] == "chat.done", done
    usage: dict[str, Any] = done["usage"]
    return usage


def loaded_column(listing: str) -> dict[str, str]:
    """`kvd models`'s "loaded" column by model, read at the header's offsets (cells may hold spaces)."""
    header, *rows = listing.splitlines()
    at, end = header.index("loaded"), header.index("runs")
    return {row.split()[0]: row[at:end].strip() for row in rows}


def kvd(data_dir: Path, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "daemon.cli", *args, "--data-dir", str(data_dir)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_switches_and_restarts_keep_each_models_cache_and_the_listings_show_them(tmp_path: Path) -> None:
    data = tmp_path / "data"
    d = DaemonProcess(data)
    try:
        with d.client() as c:
            own = {m: c.request("session.create", model=m)["session"]["id"] for m in (TINY, SWA)}
            for m in (TINY, SWA):
                say(c, own[m], "hello")
            switching = c.request("session.create")["session"]["id"]
            say(c, switching, "start", model=TINY)
            say(c, switching, "and on", model=SWA)
            for n in range(10):  # each switch finds the cache its model kept
                usage = say(c, switching, f"switch {n}", model=(TINY, SWA)[n % 2])
                assert usage["restored_from"] != "none", (n, usage)
            ps = json.loads(kvd(data, "ps", "--json"))
            assert {m["model"] for m in ps} == {TINY, SWA} and all(set(m) == PS_FIELDS for m in ps)
            table = kvd(data, "ps")
            for word in ("model", "state", "memory", "context", "idle", "unloads in", f"{TINY} (default)", SWA):
                assert word in table, table
            listing = kvd(data, "models").splitlines()
            assert listing[0].split()[:9] == ["model", "from", "architecture", "size", "encoding", "caches",
                                               "context", "loaded", "runs"]
            rows = {line.split()[0]: line for line in listing[1:]}
            assert "8192" in rows[TINY] and "8192" in rows[SWA]
            assert loaded_column("\n".join(listing))[SWA] == "idle"
        assert d.terminate() == 0
        d = DaemonProcess(data)
        with d.client() as c:
            for m in (TINY, SWA):  # each conversation restores its own model's cache after the restart
                usage = say(c, own[m], "after the restart")
                assert usage["restored_from"] != "none" and usage["model"] == m, usage
            after = loaded_column(kvd(data, "models"))
            assert (after[TINY], after[SWA], after["builtin:smollm2"]) == ("idle", "idle", "no")
    finally:
        d.terminate()
    gone = loaded_column(kvd(data, "models"))
    assert gone[TINY] == "-"  # no daemon answers: the loaded column says nothing


def test_models_pull_prepares_a_model_before_its_first_use(tmp_path: Path) -> None:
    out = kvd(tmp_path, "models", "pull", "builtin:tiny-swa")
    assert out.startswith("kvd: builtin:tiny-swa is ready in ") and (tmp_path / "models" / "tiny-swa").is_dir()
    missing = subprocess.run([sys.executable, "-m", "daemon.cli", "models", "pull", "--data-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "kvd models pull needs a NAME" in missing.stderr
