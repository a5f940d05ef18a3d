"""The decode step's profile: where the engine thread's wall time goes, step by step.

Off by default and free when off (the engine holds None and asks nothing);
on with `[decode] profile = true` or `KVD_PROFILE=1`. Each decode step's
wall time, from its start to the next one's, is split into sections, each
timed by the monotonic clock and the thread's CPU clock at its end (`lap`):

- graph: building the step's graph (the model call, the sampler's ops);
- launch: `mx.async_eval`, handing the graph to the device (on a GPU the
  host encodes its kernels here; MLX's CPU backend waits here until all but a
  few of the graph's ops have run, so on the CPU this is most of the compute);
- device: waiting for the device (`tolist`, `item` or `eval` of a result
  not computed yet), the GIL's return after it included;
- books: kvd's bookkeeping (each row's tokens, stops, the detokenizer, the
  events, a finished answer's cache kept);
- handoff: the one hand-off of the step's events to the event loop
  (engine/handoff.py);
- prefill: a prefill chunk run in the same engine step;
- other: the rest of the engine's loop (its inbox, admission, the store).

Two figures come from the clocks rather than a section: `gil` is the time
the thread was neither running nor waiting for a core in the sections that
hold the GIL (graph, books, handoff, other: wall - CPU - run-queue wait),
which is the time it waited for the GIL (the event loop held it);
`runq` is its wait for a core (Linux's /proc/thread-self/schedstat: the
machine's load, not kvd's). `loop` is the event loop's time delivering the
hand-offs (measured on the loop). Each answer gets one summary line in the
log at its end: its decode steps' sections, per token.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

PROFILE_ENV = "KVD_PROFILE"
SECTIONS = ("graph", "launch", "device", "books", "handoff", "prefill", "other")
# The GIL held throughout: what else they wait for is the GIL. `mx.async_eval` and the device waits release
# it, and on MLX's CPU backend async_eval itself waits until all but a few of the graph's ops have run.
GIL_SECTIONS = ("graph", "books", "handoff", "other")
FIGURES = (*SECTIONS, "gil", "runq", "loop", "step")


def wanted(configured: bool, env: dict[str, str] | None = None) -> bool:
    """Whether to profile: the config's `profile`, or KVD_PROFILE set to anything but 0/off/empty."""
    value = (os.environ if env is None else env).get(PROFILE_ENV, "")
    return configured or value.lower() not in ("", "0", "off", "false", "no")


@dataclass(frozen=True)
class Mark:
    """The profile's totals at one moment (an answer's entry into decoding): seconds by figure, steps."""

    totals: tuple[float, ...]
    steps: int
    rows: int


class StepProfile:
    """One engine thread's decode steps, split into sections (engine thread only, but `loop_s`)."""

    def __init__(self, loop_seconds: object = None) -> None:
        """`loop_seconds`: an object whose `loop_s` is the event loop's delivery time so far (the Handoff)."""
        self.totals = dict.fromkeys(FIGURES, 0.0)
        self.cpu = dict.fromkeys(SECTIONS, 0.0)  # the thread's CPU seconds in each section
        self.steps = 0
        self.rows = 0  # rows summed over the steps: rows / steps is the batch
        self._loop = loop_seconds
        self._t: float | None = None  # the last lap's monotonic time (None: no step under way)
        self._c = 0.0  # and the thread's CPU time then
        self._step_t = self._step_runq = self._step_loop = 0.0
        self._gil_wall = self._gil_cpu = 0.0  # this step's GIL sections' wall and CPU
        self._schedstat: int | None = None
        try:
            self._schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:  # not Linux: no run-queue figure (it then counts as GIL wait)
            self._schedstat = None

    def _runq(self) -> float:
        if self._schedstat is None:
            return 0.0
        try:
            return int(os.pread(self._schedstat, 128, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return 0.0

    def lap(self, section: str) -> None:
        """The time since the last lap was `section`'s."""
        t, c = time.perf_counter(), time.thread_time()
        if self._t is None:
            return
        wall, cpu = t - self._t, c - self._c
        self.totals[section] += wall
        self.cpu[section] += cpu
        if section in GIL_SECTIONS:
            self._gil_wall += wall
            self._gil_cpu += cpu
        self._t, self._c = t, c

    def begin(self, rows: int) -> None:
        """A decode step of `rows` rows starts: the last one ends here (what was not lapped is "other")."""
        if self._t is not None:
            self.lap("other")
            self._end_step()
        else:
            self._t, self._c = time.perf_counter(), time.thread_time()
        self._step_t, self._step_runq = self._t, self._runq()
        self._step_loop = float(getattr(self._loop, "loop_s", 0.0))
        self.steps += 1
        self.rows += rows

    def _end_step(self) -> None:
        assert self._t is not None
        runq = self._runq() - self._step_runq
        self.totals["step"] += self._t - self._step_t
        self.totals["runq"] += runq
        self.totals["gil"] += max(0.0, self._gil_wall - self._gil_cpu - runq)
        self.totals["loop"] += float(getattr(self._loop, "loop_s", 0.0)) - self._step_loop
        self._gil_wall = self._gil_cpu = 0.0

    def handed(self, *, decoding: bool) -> None:
        """The engine step's events are handed to the loop; a step ends here if no row decodes any more."""
        self.lap("handoff")
        if not decoding:
            self.pause()

    def pause(self) -> None:
        """No row decodes any more: the step under way ends now, and idle time is nobody's."""
        if self._t is not None:
            self.lap("other")
            self._end_step()
        self._t = None

    def mark(self) -> Mark:
        return Mark(tuple(self.totals[f] for f in FIGURES), self.steps, self.rows)

    def summary(self, since: Mark, tokens: int) -> str:
        """Per token since `since` (an answer's decode): each section in ms, the batch it ran in."""
        steps = self.steps - since.steps
        if tokens <= 0 or steps <= 0:
            return "no decode steps"
        per = {f: (self.totals[f] - since.totals[i]) * 1000 / tokens for i, f in enumerate(FIGURES)}
        split = ", ".join(f"{f} {per[f]:.3f}" for f in SECTIONS)
        return (f"{tokens} tokens in {steps} steps (batch {(self.rows - since.rows) / steps:.1f}), ms per token: "
                f"step {per['step']:.3f} = {split}; gil {per['gil']:.3f}, runq {per['runq']:.3f}, "
                f"loop {per['loop']:.3f}")

    def figures(self) -> dict[str, float]:
        """Every figure so far in ms per step (and each section's CPU, `<section>_cpu`), with the steps and the
        mean batch (bench/gpu.py's table)."""
        n = max(self.steps, 1)
        return {**{f: self.totals[f] * 1000 / n for f in FIGURES},
                **{f"{f}_cpu": self.cpu[f] * 1000 / n for f in SECTIONS}, "steps": float(self.steps),
                "batch": self.rows / n}
