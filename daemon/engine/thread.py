"""The engine thread: the one thread that owns the model and every MLX array.

Jobs come in through a queue; events go out once per step (handoff.py: one
wake-up of the event loop). This file is the thread: its loop, its inbox,
loading the model, idle upkeep and the statistics; what a step does to the
answers (admit, prefill, decode, finish, cancel) is a `Steps` (steps.py),
made once the model is loaded, which the engine owns and calls.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import protocol as p
from cachestore import ARRIVED, IDLE, READS_REPORTED, STOPPING, WOKEN, Abandoned, Stepped, Took
from common.threadname import name_spawned, name_thread
from common.tiers import RESIDENT

from ..config import Config
from ..events import AnswerError
from . import heap
from .handoff import Handoff
from .jobs import Cancel, Forget, Inbox, ReadReported, RoomFreed, StatusQuery, Stop
from .lockstep import Op
from .profile import StepProfile, wanted
from .running import Answer, EngineStatistics
from .scheduler import Phase, Scheduler
from .stage import TokenizerStage
from .steps import Steps

if TYPE_CHECKING:
    from cachestore import Pool, SessionCaches

    from .lockstep import Lockstep


log = logging.getLogger("kvd.engine")


MAINTAIN_EVERY = 5.0  # seconds between idle-demotion checks while nothing runs

T = TypeVar("T")


class Engine:
    """Owns the model; serves Answers through one decode batch (decode.py)."""

    def __init__(self, config: Config, model_dir: Path | None = None, lockstep: Lockstep | None = None,
                 pool: Pool | None = None):
        """`model_dir`: the model already prepared (daemon/models/sources.py) by `kvd serve` before it
        listened; None prepares it on the engine thread. `lockstep`: this rank's end of the group
        when the model is sharded across ranks (lockstep.py; rank 0 sends, followers apply). `pool`:
        the memory budgets the other loaded models' engines share (registry.py); None: the first
        engine makes them, at its load, from the device's memory."""
        self.config = config
        self.pool = pool
        self.model_dir = model_dir
        self.lockstep = lockstep
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self._inbox = Inbox()  # Answer, Cancel, Forget, Stop, Status, ReadReported, RoomFreed
        self._thread = threading.Thread(target=self._run, name="kvd-engine", daemon=True)
        self.out = Handoff()  # every event a step makes, to the event loop in one wake-up at its end
        # The step profiler (profile.py: `[decode] profile`, KVD_PROFILE=1); None, and free, when off.
        self.profile = StepProfile(self.out) if wanted(config.profile) else None
        # Every answer, in its phase: running, restoring, and waiting past max_generations.
        self.scheduler: Scheduler[Answer] = Scheduler(
            max_running=config.max_generations, prefill_step=config.prefill_step_size,
            prefill_slice=config.prefill_slice,
            # Running caches count against the resident budget (not across ranks: each rank's share
            # differs, and every rank must admit alike).
            budget=config.resident_bytes if lockstep is None else None)
        self.max_context: int | None = None  # the model's context length, once loaded (if it says)
        self.steps: Steps | None = None  # what moves the answers along, once the model is loaded
        self.caches: SessionCaches | None = None  # every idle session's cache, by tier
        self.stats: dict[str, Any] = {}  # replaced wholesale; safe to read from other threads
        self.warm_up_ms: float | None = None  # the first forward, run before `ready`
        self.device: str | None = None  # the device line (daemon/device.py), once loaded
        self.weights_bytes: int | None = None  # the model's weights in memory, once loaded (the registry's)
        self._prefetch = False  # sessions left to page in from disk, one per idle tick (ranks in lockstep)
        self._refault = False  # fault the heap's reserve in again once the planned prefetch is done
        self.stage = TokenizerStage(config.model)  # the tokenizer stage (`tokenize`): its copy made at the load

    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        """A new config (tests swap one in between turns) reaches the steps too."""
        self._config = config
        if (steps := getattr(self, "steps", None)) is not None:
            steps.config = config

    # --- called from other threads ---

    def start(self) -> None:
        self._thread.start()

    def submit(self, answer: Answer) -> None:
        if self.caches is not None:  # (the cache store's writes give way to an answer's first token)
            self.caches.tell(ARRIVED)
        self._inbox.put(answer)

    def cancel(self, session_id: str) -> None:
        self._inbox.put(Cancel(session_id))

    async def tokenize(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(tokenizer, *args)` in the model's tokenizer stage (stage.py), where a turn's every render and
        encode runs (prompt.py), with the stage's own copy of the tokenizer."""
        return await self.stage.run(fn, *args)

    @property
    def stage_tokenizer(self) -> Any:
        return self.stage.tokenizer

    def forget(self, session_id: str) -> None:
        """Drop a deleted session's cache from every tier (it must not be generating)."""
        self._inbox.put(Forget(session_id))

    def query_status(self, reply: Callable[[dict[str, Any]], None]) -> None:
        """Ask for fresh statistics: answered between steps, once any finished answer's cache is kept (on disk too)."""
        self._inbox.put(StatusQuery(reply))

    def stop(self, timeout: float | None = None) -> None:
        """Cancel whatever runs (each answer gets its Done) and end the thread."""
        self._inbox.put(Stop())
        self._thread.join(timeout)

    def statistics(self) -> EngineStatistics:
        """The answers running and waiting now: read on the engine thread, or while it is not running."""
        s = self.scheduler.statistics()
        answers = {a.key: a.statistics() for a in self.scheduler.started()}
        return EngineStatistics(running=s.running, waiting=s.waiting, prefilling=s.prefilling,
                                decoding=s.decoding, answers=answers)

    # --- the engine thread (tests drive them on their own thread, without start()) ---

    def load(self) -> None:
        """Load the model, open the caches and warm up: the first thing the engine thread does."""
        import mlx.core as mx
        from mlx.utils import tree_flatten

        from ..device import current
        from ..models.sources import prepare_model
        from .budgets import open_caches, shared_budgets
        from .modelload import load_model, warm_up, weights_label
        from .quantized import make_cache

        c = self.config
        loaded = load_model(c.model, self.model_dir or prepare_model(c.model, c.models_dir))
        c = self.config = self._on_device(c)
        if self.lockstep is not None:
            from .shard import shard

            shard(c.model, loaded, self.lockstep.group)
        kv_bits = c.kv_bits or None
        params: Any = tree_flatten(loaded.model.parameters())
        if refusal := current().kv_bits_refusal(c.kv_bits, weights_label(params, {})):
            raise ValueError(refusal)
        weights = sum(int(v.nbytes) for _, v in params)
        self.pool = shared_budgets(c, self.pool, weights)
        if self.lockstep is None:
            self.scheduler.budget = self.pool.budgets[RESIDENT]  # running caches count against the resident tier's
        self.caches = open_caches(c, loaded, kv_bits, self.pool)
        self.model, self.tokenizer, self.max_context = loaded.model, loaded.tokenizer, loaded.max_context
        self.device = loaded.device
        self.weights_bytes = weights
        self.steps = Steps(c, self.model, self.tokenizer, self.caches, scheduler=self.scheduler,
                           lockstep=self.lockstep, max_context=self.max_context,
                           publish=self._publish_stats, out=self.out, profile=self.profile)
        if self.lockstep is not None:
            self.lockstep.stream = self.steps.stream
            self.lockstep.open_doorbell()
        probe = make_cache(self.model, kv_bits)
        from .draws import Draws

        draws = Draws(c.temperature, c.top_p, seed=0, size=1) if c.temperature > 0 else None
        with mx.stream(self.steps.stream):  # the stream every step runs on: its worker starts before `ready`
            self.warm_up_ms = warm_up(self.model, self.tokenizer, probe, current().warm_up_tokens,
                                      draw=draws.take if draws is not None else None)
        if self.lockstep is None:  # (ranks run one graph: each would decide alone)
            from .prefill import last_position

            self.steps.last = last_position(self.model, lambda: make_cache(self.model, kv_bits))
        # The tokenizer stage works on a copy of its own (`tokenize`): made here,
        # before `ready`, so no first turn waits for it (Gemma 3's 262k-token one: 2-3 s of a first
        # turn's TTFT after a restart on the busy 2-core CPU, when it was made after `ready`).
        self.stage.tokenizer = copy.deepcopy(self.tokenizer)
        self._connect_caches(probe)
        if self.lockstep is not None:
            import random

            # Every rank samples the same tokens from the same logits: the same seed, the same draws.
            mx.random.seed(self.lockstep.share(random.getrandbits(31)))

    def _on_device(self, c: Config) -> Config:
        """The config with what it leaves to the device decided (daemon/device.py)."""
        from ..device import configured, current

        c = configured(c, current())
        self.scheduler.prefill_step = c.prefill_step_size
        return c

    def _connect_caches(self, probe: list[Any]) -> None:
        """What the cache store and the admission need from the engine, once the model is warm (not
        across ranks: they wait for reads in step, and each rank's share of the budgets differs). Bytes
        are admitted across every loaded model's caches (`SessionCaches.admit`); the pool wakes this
        thread to let its own go for another model, or when room a queued answer waits for came back."""
        assert self.caches is not None
        alone = self.lockstep is None
        cost = self.caches.connect(probe, running_bytes=self.scheduler.held_bytes,
                                   restoring=lambda key: (a := self.scheduler.get(key)) is not None
                                   and a.read is not None,
                                   on_read=(lambda: self._inbox.put(ReadReported())) if alone else None,
                                   on_room=(lambda: self._inbox.put(RoomFreed())) if alone else None)
        if self.steps is not None:
            self.steps.cost = cost  # an answer's `need`: what its cache may reach
        if alone:
            self.scheduler.room = self.caches.admit

    def open(self) -> None:
        """Load (a failure is kept in `load_error`), plan the prefetch, publish: then `ready`."""
        try:
            self.load()
        except BaseException as e:  # reported to every client, its traceback logged by whoever loaded it:
            self.load_error = e  # `kvd serve` at start (startup.py, then it stops), the registry after
        if self.caches is not None and self.config.prefetch:
            import mlx.core as mx

            from ..device import current

            # Ranks in lockstep read one session per idle tick, in step (`_prefetch_one`); one rank queues them all.
            planned = self.caches.prefetch(current().prefetch_bytes(in_use=mx.get_active_memory()),
                                           in_step=self.lockstep is not None)
            self._prefetch, self._refault = self.lockstep is not None and planned > 0, planned > 0
        self._publish_stats()
        self.ready.set()

    def _run(self) -> None:
        name_thread("kvd-engine")  # the kernel's name too: top -H, py-spy, bench/hostcost.py
        self.open()
        name_spawned("kvd-mlx")  # MLX's and the BLAS's workers, started by the load, took this thread's name
        ls = self.lockstep
        # Idle, rank 0 still speaks (an IDLE tick) often enough for the followers' watchdog.
        idle_wait = MAINTAIN_EVERY if ls is None else min(MAINTAIN_EVERY, ls.heartbeat)
        while True:
            try:
                if self.scheduler.started() or self._prefetch:
                    cmd = self._inbox.get(block=False)
                else:
                    if ls is not None:
                        ls.sleep()  # the followers wait without spinning
                    cmd = self._inbox.get(timeout=idle_wait)
            except queue.Empty:
                cmd = None
            with ls.watched() if ls is not None else contextlib.nullcontext():
                if cmd is None and not self.scheduler.started():
                    if ls is not None:
                        ls.send(Op.IDLE)
                    self.idle()
                if isinstance(cmd, Stop):
                    if ls is not None:
                        ls.send(cmd)
                    self.close()
                    self._release()
                    self._inbox.close(self._late)
                    return
                if cmd is not None:
                    if ls is not None and not isinstance(cmd, (StatusQuery, ReadReported, RoomFreed)):
                        ls.send(cmd)
                    self.apply(cmd)
                if self._inbox.empty():  # every request so far handled: the engine moves one step
                    if ls is not None:
                        ls.send(Op.STEP)
                    self.advance()

    # --- what rank 0's loop does, and a follower on rank 0's word (follower.py) ---

    def idle(self) -> None:
        """Upkeep while nothing runs: the next planned prefetch, else demote idle caches."""
        if self.scheduler.started() or self.caches is None:
            return
        if self._prefetch:
            self._prefetch = self.caches.prefetch(in_step=True) > 0
        else:
            self.caches.tell(IDLE)
            self._refault_heap()
        self._publish_stats()

    def _refault_heap(self) -> None:
        """Once the start's prefetch is done: its caches took (up to) their bytes of the warm-up's heap
        reserve, so fault that much in again for a first turn's buffers (engine/heap.py). On the engine
        thread, before the next request: a turn that came meanwhile would have faulted those pages itself."""
        if not self._refault or self._prefetch or self.caches is None:
            return
        if not (prefetched := self.caches.statistics()["prefetched"])["reading"]:
            self._refault = False
            t0 = time.perf_counter()
            if touched := heap.reserve(int(prefetched["bytes"])):
                log.info("after the start's prefetch, %d MiB of heap faulted in again in %.0f ms", touched >> 20,
                         (time.perf_counter() - t0) * 1000)

    def _late(self, job: Any) -> None:
        """What reached the inbox after the thread stopped: an answer is cut before it began, as a stop cuts
        one still waiting (its turn keeps it as 'cancelled'); the rest needs no one."""
        if isinstance(job, Answer):  # delivered as the hand-off delivers (on its sink's loop), now
            out = Handoff()
            job.taken(out)
            job.never_started(self.max_context)  # (its choices too)
            with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody is left to hear it
                out.flush(force=True)

    def close(self) -> None:
        """Cancel whatever runs (each answer gets its Done), page every cache out, close the tiers."""
        if self.steps is not None:
            s = self.scheduler
            for a in [*s.phase(Phase.WAITING), *s.phase(Phase.RESTORING), *s.started()]:
                self.steps.cancel(a.key)
        self.out.flush(force=True)  # (the answers' Dones, before the caches are paged out)
        if self.caches is not None:
            self.caches.tell(STOPPING)  # every cache paged out, then the tiers closed

    def _release(self) -> None:
        """After close: let the model and its arrays go, and MLX's buffer cache with them (an unloaded
        model's memory is another's to use; daemon/engine/registry.py)."""
        self.steps = None
        self.caches = None
        self.model = self.tokenizer = None
        self.stage.close()
        import gc

        import mlx.core as mx

        gc.collect()
        mx.clear_cache()
        if sys.platform.startswith("linux"):  # glibc keeps freed arrays' pages: 1 GB model unloaded, 0.5 GB kept
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL("libc.so.6").malloc_trim(0)

    def advance(self) -> None:
        self._advance()
        self.out.flush()
        if self.profile is not None:
            self.profile.handed(decoding=self.scheduler.any_decoding())

    def apply(self, cmd: Answer | Cancel | Forget | StatusQuery | ReadReported | RoomFreed) -> None:
        self._handle(cmd)
        self.out.flush()

    def _advance(self) -> None:
        """Start what may start, then one step of the running answers."""
        if self.steps is None:
            return
        self.steps.admit_waiting()
        if self.scheduler.started():
            self.steps.step()
        if self.caches is not None:
            s = self.scheduler
            self.caches.tell(Stepped(running=bool(s.started()), wanting=s.before_first_tokens(),
                                     waiting=bool(s.phase(Phase.WAITING))))

    def step(self) -> None:
        """Handle every request submitted so far, then run one engine step.

        What the engine thread's loop does between waits; a test calls it on its own thread, after
        `load()` and without `start()`, to drive the engine one deterministic step at a time.
        """
        while True:
            try:
                cmd = self._inbox.get(block=False)
            except queue.Empty:
                break
            assert not isinstance(cmd, Stop), "stop() is for a started engine"
            self._handle(cmd)
        self._advance()
        self.out.flush(force=True)

    def _handle(self, cmd: Answer | Cancel | Forget | StatusQuery | ReadReported | RoomFreed) -> None:
        if isinstance(cmd, Answer):
            cmd.taken(self.out)
            if self.steps is None or self.caches is None:
                cmd.refuse(AnswerError(p.INTERNAL, f"the model failed to load: {self.load_error}"))
            else:
                self.steps.start(cmd)
                self.caches.tell(Took(self.scheduler.before_first_tokens()))
        elif isinstance(cmd, Cancel):
            if self.steps is not None:
                self.steps.cancel(cmd.session_id)
        elif isinstance(cmd, ReadReported):
            if self.caches is not None:
                self.caches.tell(READS_REPORTED)  # a restore or a prefetch goes on, or ends
            if self.steps is not None:
                self.steps.read_reported()
            self._refault_heap()
        elif isinstance(cmd, RoomFreed):
            self._room_freed()
        elif isinstance(cmd, Forget):
            a = self.scheduler.get(cmd.session_id)
            if self.caches is not None and (a is None or a.phase in (Phase.WAITING, Phase.RESTORING)):
                if a is not None and a.read is not None:
                    self.caches.tell(Abandoned(a.read))  # its answer starts without what the read held
                self.caches.forget(cmd.session_id)
                self._publish_stats()
        elif isinstance(cmd, StatusQuery):
            if self.caches is not None and not cmd.written:
                # Counted once disk holds what finished turns wrote, without waiting for it here.
                again = StatusQuery(cmd.reply, written=True)
                self.caches.statistics(written=lambda: self._inbox.put(again))
                return
            self._publish_stats()
            cmd.reply(self.stats)

    def _room_freed(self) -> None:
        """The budgets every model shares changed (memory.py), or room came back, or another model waits
        for room this one's older caches hold."""
        if self.pool is not None and self.lockstep is None:
            self.scheduler.budget = self.pool.budgets[RESIDENT]
        if self.caches is not None and self.caches.tell(WOKEN):  # (queued answers are tried again: `_advance`)
            self._publish_stats()  # where the sessions' caches are now

    def _publish_stats(self) -> None:
        caches = self.caches.statistics(where=True) if self.caches is not None else {}
        where = caches.pop("locations", {})  # for this model only
        kept_for = caches.pop("kept_for", {})  # other models' caches
        s = self.statistics()
        self.stats = {"generating": s.running, "waiting": s.waiting,
                      "answering": {sid: asdict(a) for sid, a in s.answers.items()},
                      "prefetched": caches.pop("prefetched", {}), "tiers": caches, "locations": where,
                      "kept_for": kept_for,
                      # the memory budgets every loaded model shares: their bytes, in all and by model
                      "budgets": self.pool.statistics() if self.pool is not None else {},
                      "warm_up_ms": self.warm_up_ms, "device": self.device}
        if self.profile is not None:
            self.stats["profile"] = self.profile.figures()  # ms per decode step so far (profile.py)
        if (ls := self.lockstep) is not None:  # the control channel's traffic, from this rank's side
            self.stats["ranks"] = {"world_size": ls.size, "messages": ls.messages, "bytes": ls.bytes}

