"""The step profiler's split (daemon/engine/profile.py) for mlx-lm's own loops, from outside: bench/gpu.py's.

mlx-lm's `stream_generate` and mlx_lm.server's batched generator cannot be
instrumented from inside, so this wraps what every decode step calls on the
thread that calls the model: the model's `__call__` (graph: building the
step's graph), `mx.async_eval` (launch), and the waits for a result (`mx.eval`,
`array.item`, `array.tolist`: device). A step runs from one model call to the
next on that thread; what is left of it is the loop's own work (books:
sampling's bookkeeping, the detokenizer, the server's queues), and, as in
kvd's profiler, `gil` is the thread's wall time neither on a core nor waiting
for one outside the launch and the device waits, `runq` its wait for a core
(Linux). A "step" over IDLE_S is the generator waiting for its next request
and is left out. The figures are kvd's profiler's, ms per step.

    from sections import Sections
    with Sections() as s:            # in-process: stream_generate inside
        ...
    s.figures()

    python bench/sections.py OUT.json -m mlx_lm.server --model M --port P
        # mlx_lm.server, its generator's steps split; OUT.json written when it gets SIGTERM
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import threading
import time
from typing import Any

import mlx.core as mx

SECTIONS = ("graph", "launch", "device", "books")
IDLE_S = 0.5  # a "step" this long holds the generator's wait for its next request: not a step


def _runq() -> float:
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


class Sections:
    """mlx-lm's decode steps split into sections, on the thread that calls the model (patches undone on exit)."""

    def __init__(self) -> None:
        self.wall = dict.fromkeys((*SECTIONS, "gil", "runq", "step"), 0.0)
        self.steps = 0
        self.thread: int | None = None  # the thread that calls the model
        self._step: tuple[float, float, float] | None = None  # this step's start: wall, CPU, run queue
        self._in = 0.0  # wall in the wrapped sections of this step
        self._off = 0.0  # of it, off-CPU in the device waits (not the GIL's)
        self._undo: list[tuple[Any, str, Any]] = []
        self._now = dict.fromkeys(("graph", "launch", "device"), 0.0)  # this step's sections, kept at its end

    def _timed(self, section: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.thread:
                if section != "graph" or self.thread is not None:
                    return fn(*args, **kwargs)
                self.thread = threading.get_ident()
            if section == "graph":
                self._boundary()
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                wall = time.perf_counter() - t0
                self._now[section] += wall
                self._in += wall
                if section != "graph":  # (launch and the device waits release the GIL)
                    self._off += wall - (time.thread_time() - c0)
        return wrapped

    def _boundary(self) -> None:
        """A model call: the step before it ends here."""
        now = (time.perf_counter(), time.thread_time(), _runq())
        if self._step is not None and now[0] - self._step[0] < IDLE_S:
            wall, cpu, runq = (now[i] - self._step[i] for i in range(3))
            self.steps += 1
            for section, took in self._now.items():
                self.wall[section] += took
            self.wall["step"] += wall
            self.wall["books"] += max(0.0, wall - self._in)
            self.wall["runq"] += runq
            self.wall["gil"] += max(0.0, wall - cpu - self._off - runq)
        self._step, self._in, self._off = now, 0.0, 0.0
        self._now = dict.fromkeys(self._now, 0.0)

    def __enter__(self) -> Sections:
        from mlx_lm.models import llama

        self._patch(llama.Model, "__call__", "graph")
        self._patch(mx, "async_eval", "launch")
        self._patch(mx, "eval", "device")
        self._patch(mx.array, "item", "device")
        self._patch(mx.array, "tolist", "device")
        return self

    def _patch(self, owner: Any, name: str, section: str) -> None:
        fn = getattr(owner, name)
        self._undo.append((owner, name, fn))
        setattr(owner, name, self._timed(section, fn))

    def __exit__(self, *exc: object) -> None:
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)
        self._undo.clear()

    def reset(self) -> None:
        """Forget what was measured so far (a warm-up's steps); the thread stays known."""
        self.wall = dict.fromkeys(self.wall, 0.0)
        self.steps, self._step = 0, None

    def figures(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {**{k: v * 1000 / n for k, v in self.wall.items()}, "steps": float(self.steps)}


def serve(out: str, argv: list[str]) -> None:
    """Run `python -m MODULE ARGS` (mlx_lm.server) with its steps split; write the figures to `out` on SIGTERM."""
    s = Sections().__enter__()

    def dump(*_: object) -> None:
        with open(out, "w") as f:
            json.dump(s.figures(), f)
        os._exit(0)

    signal.signal(signal.SIGTERM, dump)
    signal.signal(signal.SIGUSR1, lambda *_: s.reset())  # the bench's warm-up is over
    assert argv[0] == "-m", "python bench/sections.py OUT.json -m MODULE ARGS..."
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
