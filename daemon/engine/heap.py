"""Keep the memory a forward frees for the next one: glibc's malloc tuned, and a reserve faulted in before a first turn.

Why. On MLX's Linux CPU backend every array's buffer comes from malloc, and
MLX's own buffer cache holds 32 MiB and reuses a buffer only for a request
of nearly its size (within two pages), so from one turn to the next, whose
attention intermediates and copies of the cache are a few hundred tokens
longer, almost every large buffer is malloc's. glibc then decides from its
history: a chunk over its mmap threshold (128 KiB at start, raised to the
largest mmapped chunk freed so far, at most 32 MiB) is a fresh mapping
every time, and free memory at the top of a heap over its trim threshold is
returned to the system. Fresh memory costs a page fault per 4 KiB page on
first touch: 1.4-1.9 ms a MB on this project's 2-core VM. So a daemon just
started (or one whose history kept the thresholds low) faulted in tens of MB
per turn that a long-running one reused: measured with bench/firstturn.py,
builtin:tiny at 5k tokens, 17-42k page faults in a first turn after a start
and 8-46k in the turns after it, against ~0 in a daemon that had prefilled
a long conversation; SmolLM2 20-60k faults a turn either way.

What. :func:`tune`, first thing in `kvd serve` (before any thread or MLX):
one malloc arena for every thread (MLX evaluates on its own threads, and a
thread's arena gives back a whole 64 MiB heap once it is free, whatever the
thresholds), chunks under 32 MiB from the heap, and `keep` bytes always kept
at the heap's top when it is trimmed. :func:`reserve` then touches `keep`
bytes of that heap once (malloc, write, free), so the first turn's buffers
are pages already faulted in: after the warm-up, before `ready`, and again
after a start's prefetch (whose caches took the reserve's pages; engine/thread.py).

Where. glibc only (Linux); elsewhere both do nothing. The device policy
says whether and how much (daemon/device.py: the CPU backend; a GPU's
arrays are not malloc's). `KVD_HEAP=off` leaves malloc as it is (an A/B).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("kvd.heap")

__all__ = ["ENV_VAR", "M_ARENA_MAX", "M_MMAP_THRESHOLD", "M_TOP_PAD", "M_TRIM_THRESHOLD", "MMAP_THRESHOLD",
           "glibc", "reserve", "tune", "tune_as_policy", "tuned"]

ENV_VAR = "KVD_HEAP"
# mallopt(3)'s parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit): bigger chunks stay mappings
CHUNK = 16 << 20  # the reserve is touched in pieces under the mmap threshold, so they come from the heap

_state = {"keep": 0}


def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (mallopt's parameters are glibc's), else None."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError, AttributeError):  # not a glibc system
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def tune(keep: int, env: dict[str, str] | None = None) -> str:
    """Tune glibc's malloc to keep `keep` bytes of freed memory for reuse (see the module's doc); the
    start line's word on it. Call before any other thread starts (the arena count binds threads as
    they first allocate) and before mlx is imported."""
    env = dict(os.environ) if env is None else env
    if keep <= 0:
        return "heap: as the C library keeps it"
    if env.get(ENV_VAR, "").lower() == "off":
        return f"heap: as the C library keeps it ({ENV_VAR}=off)"
    libc = glibc()
    if libc is None:
        return "heap: as the C library keeps it (not glibc)"
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TOP_PAD, keep), (M_TRIM_THRESHOLD, 2 * keep)))
    if not ok:
        return "heap: as the C library keeps it (mallopt refused)"
    _state["keep"] = keep
    return f"heap: {keep >> 20} MiB of freed memory kept for the next forward"


def tune_as_policy() -> str:
    """:func:`tune` as the device policy of the installed backend says (read without importing MLX)."""
    from ..device import Device, installed_backend, policy

    backend = installed_backend() or "cpu"
    return tune(policy(Device(backend, backend)).heap_keep)


def tuned() -> int:
    """The bytes :func:`tune` keeps (0: malloc untouched)."""
    return _state["keep"]


def reserve(nbytes: int | None = None) -> int:
    """Fault in `nbytes` (default: what :func:`tune` keeps) of the heap and free them, so the next
    allocations find pages already touched; the bytes touched (0 where malloc is not tuned)."""
    nbytes = tuned() if nbytes is None else min(nbytes, tuned())
    libc = glibc() if nbytes > 0 else None
    if libc is None:
        return 0
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = []
    try:
        for _ in range(-(-nbytes // CHUNK)):
            p = libc.malloc(CHUNK)
            if not p:
                break
            ctypes.memset(p, 0, CHUNK)  # a write per page: the faults happen here, not in a turn
            chunks.append(p)
    finally:
        for p in reversed(chunks):
            libc.free(p)
    return len(chunks) * CHUNK
