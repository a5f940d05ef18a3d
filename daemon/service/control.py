"""Running kvd as a service from the command line: `serve --detach`, `stop`, `logs`.

The data directory's lock (lockfile.py) is the one truth about whether a
daemon runs: `stop` signals the pid the lock's holder wrote and waits for the
lock to be released, which happens only when that process has exited, after
it paged every cache out and closed its database.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import durable
from protocol import DAEMON_FILE, default_data_dir

from .. import __version__
from .lockfile import holder_pid, is_locked
from .logfile import follow, tail

READY_MARK = "kvd: listening on "
ANSWERING_MARK = "kvd: ready to answer"  # the model loaded and warmed up (a detached start waits for it)
DETACHED_FLAG = "--detached-child"


def write_daemon_file(data_dir: Path, url: str, log_file: Path) -> Path:
    """daemon.json: where clients find the daemon (written once it listens)."""
    path = data_dir / DAEMON_FILE
    info = {"url": url, "pid": os.getpid(), "version": __version__, "started_at": time.time(),
            "log_file": str(log_file)}
    durable.write_atomic(path, json.dumps(info), mode=0o600)
    return path


def read_daemon_file(data_dir: Path) -> dict[str, Any]:
    try:
        info = json.loads((data_dir / DAEMON_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def running_line(data_dir: Path) -> str:
    """`kvd is already running (pid N, ws://...)` for the daemon that holds `data_dir`."""
    info = read_daemon_file(data_dir)
    pid = holder_pid(data_dir) or info.get("pid")
    url = info.get("url") if info.get("pid") == pid else None
    where = f"pid {pid if pid is not None else '?'}" + (f", {url}" if url else ", still starting")
    return f"kvd is already running ({where}) for {data_dir}; stop it with: kvd stop --data-dir {data_dir}"


def data_dir_flag(data_dir: Path) -> str:
    """` --data-dir D` for a hint's command, or nothing for the default one: a command run as written must
    reach this daemon (`kvd stop` alone looks in the default data directory)."""
    if data_dir.expanduser().resolve() == default_data_dir().expanduser().resolve():
        return ""
    return f" --data-dir {shlex.quote(str(data_dir))}"


def detach(argv: list[str], log_file: Path, data_dir: Path) -> int:
    """Start `kvd serve` in its own session and return once it can answer (or has failed).

    The child writes its start-up lines to a pipe read here, so a failure
    that stops it at start, also one that only loading the model reveals
    after it listens, is shown exactly as in the foreground, with a non-zero
    exit; once its model is loaded it stops writing to the pipe and logs only
    to its file.
    """
    child = subprocess.Popen([sys.executable, "-m", "daemon.cli", *argv, DETACHED_FLAG],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    assert child.stderr is not None
    url = "?"
    told = False  # whether the child said why it stops
    for line in child.stderr:
        if READY_MARK in line:
            url = line.split(READY_MARK, 1)[1].split()[0]
        if ANSWERING_MARK in line:
            child.stderr.close()
            where = data_dir_flag(data_dir)
            print(f"kvd: started (pid {child.pid}) on {url}, ready to answer\n"
                  f"kvd: logs: {log_file} (kvd logs -f{where}); chat: kvchat{where}; "
                  f"stop it with: kvd stop{where}", file=sys.stderr)
            return 0
        sys.stderr.write(line)
        told = told or said_why(line)
    code = child.wait()
    if not told:  # a child that said why it stopped has said it all; its log may not have it
        print(f"kvd: the daemon exited ({code}) before it could answer; its log: {log_file}", file=sys.stderr)
    return code or 1


def said_why(line: str) -> bool:
    """Whether a start-up line is the child's own reason for stopping (an error, or another kvd holding the
    data directory), after which a detached start adds nothing."""
    return line.startswith("kvd: error:") or line.startswith("kvd is already running")


def leave_terminal() -> None:
    """In the detached child, once it listens: stdout and stderr go nowhere, the file has the log."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)


def stop(data_dir: Path, timeout: float) -> int:
    """SIGTERM the data directory's daemon; wait until it has released its lock."""
    if not is_locked(data_dir):
        print(f"kvd stop: kvd is not running for {data_dir}", file=sys.stderr)
        return 0
    pid = holder_pid(data_dir)
    if pid is None:
        print(f"kvd stop: a kvd holds {data_dir} but its pid is unknown; look for it with: "
              "pgrep -af 'kvd serve'", file=sys.stderr)
        return 1
    t0 = time.monotonic()
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    except PermissionError:
        print(f"kvd stop: not allowed to signal pid {pid} (another user's kvd?)", file=sys.stderr)
        return 1
    print(f"kvd stop: stopping kvd (pid {pid}): paging caches out...", file=sys.stderr, flush=True)
    while is_locked(data_dir):
        if time.monotonic() - t0 > timeout:
            print(f"kvd stop: kvd (pid {pid}) is still stopping after {timeout:.0f} s; wait, or "
                  f"kill -9 {pid} (acknowledged turns are safe; caches not yet written are "
                  "rebuilt from the transcripts)", file=sys.stderr)
            return 1
        time.sleep(0.05)  # a command polling another process's exit, not a test waiting
    print(f"kvd stop: stopped (pid {pid}, {time.monotonic() - t0:.1f} s)", file=sys.stderr)
    return 0


def logs(log_file: Path, lines: int, follow_: bool) -> int:
    if not log_file.exists():
        print(f"kvd logs: no log at {log_file} yet (kvd serve writes it)", file=sys.stderr)
        return 1
    if not follow_:
        sys.stdout.writelines(tail(log_file, lines))
        return 0
    try:
        follow(log_file, sys.stdout, lines=lines)
    except KeyboardInterrupt:
        pass
    return 0
