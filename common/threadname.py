"""One name per thread, seen by the operating system too: `/proc/PID/task/*/comm`, `top -H`, py-spy.

Python's `threading` names live only in Python; the kernel knows every thread
of a daemon as "python" (or "kvd"), so a per-thread CPU figure (bench/hostcost.py)
or a `top -H` could not tell the engine from the event loop. `name_thread`, called
first thing on the thread it names, sets both. Linux only (prctl); elsewhere
the Python name alone. The kernel keeps 15 bytes of it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

PR_SET_NAME = 15  # prctl(2)
COMM_BYTES = 15

_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # no libc to ask: the Python name only
        _prctl = None


def name_thread(name: str) -> None:
    """Name the calling thread `name` in Python and, on Linux, in the kernel (its first 15 bytes)."""
    threading.current_thread().name = name
    if _prctl is not None:
        _prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:COMM_BYTES]), 0, 0, 0)


def name_spawned(helpers: str) -> None:
    """Name `helpers` the threads that share the calling thread's kernel name but are not it: those a
    library started from it, which inherit its name (MLX's stream and BLAS workers, started by the
    engine thread's first forward). Linux only."""
    import threading as _threading
    from pathlib import Path

    me = _threading.get_native_id()
    mine = thread_names().get(me)
    for tid, comm in thread_names().items():
        if tid != me and comm == mine:
            try:
                Path(f"/proc/self/task/{tid}/comm").write_text(helpers.encode()[:COMM_BYTES].decode(errors="ignore"))
            except OSError:  # ended meanwhile, or not Linux
                continue


def thread_names(pid: int | str = "self") -> dict[int, str]:
    """The kernel's name of each thread of process `pid`, by thread id (Linux; empty elsewhere)."""
    from pathlib import Path

    out: dict[int, str] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out[int(task.name)] = (task / "comm").read_text().strip()
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue
    return out
