"""The engine thread: the one thread that owns the model and every MLX array.

Jobs come in through a queue; events go out through a callback the server
supplies (it hops them onto the event loop with `call_soon_threadsafe`).

A turn has two phases. Prefill: the session's restored cache is fed the rest
of its prompt a chunk per step (prefill.py), first come first served, and the
last chunk's logits give the first token. Decode: the session joins mlx-lm's
BatchGenerator with that token as its one-token prompt and its cache passed in
with `insert(..., caches=...)`; the cache comes back out of the finished or
removed sequence. Each engine step runs one decode step for every session in
the batch, then one prefill chunk, so a long prefill never freezes the others.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import protocol as p

from ..config import Config
from .draft import Answers
from .jobs import (
    Cancel,
    Delta,
    Done,
    Failed,
    Forget,
    Progress,
    PromptTooLong,
    Queued,
    Started,
    Status,
    Stop,
    TurnJob,
)
from .lockstep import Kind
from .running import EngineStatistics, RunningTurn, fit_advice
from .scheduler import Scheduler

if TYPE_CHECKING:
    from cachestore import SessionCaches

    from .grammar import Constraint
    from .lockstep import Lockstep
    from .speculate import Speculation


log = logging.getLogger("kvd.engine")


MAINTAIN_EVERY = 5.0  # seconds between idle-demotion checks while nothing runs
PROGRESS_EVERY = 0.25  # seconds between Progress events of one prefill: a few a second is enough to watch


class Engine:
    """Owns the model; serves TurnJobs through one BatchGenerator."""

    def __init__(self, config: Config, model_dir: Path | None = None, lockstep: Lockstep | None = None):
        """`model_dir`: the model already prepared (daemon/models/sources.py) by `kvd serve` before it
        listened; None prepares it on the engine thread. `lockstep`: this rank's end of the group
        when the model is sharded across ranks (lockstep.py; rank 0 sends, followers apply)."""
        self.config = config
        self.model_dir = model_dir
        self.lockstep = lockstep
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self._inbox: queue.SimpleQueue[TurnJob | Cancel | Forget | Stop | Status] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvd-engine", daemon=True)
        # Running turns (by session id) and the jobs past max_generations.
        self._turns: Scheduler[TurnJob, RunningTurn] = Scheduler(
            max_running=config.max_generations, prefill_step=config.prefill_step_size,
            prefill_slice=config.prefill_slice)
        self._by_uid: dict[int, str] = {}  # sessions decoding in the batch
        self._speculating: dict[int, Speculation] = {}  # of those, the ones that may draft (by uid)
        self._answers = Answers()  # recent sessions' last answers: a regenerate drafts from the one it replaces
        self.max_context: int | None = None  # the model's context length, once loaded (if it says)
        self._grammar_view: tuple[int, Any] | None = None  # llguidance's view of the tokenizer, once asked for
        self.caches: SessionCaches | None = None  # every idle session's cache, by tier
        self.stats: dict[str, Any] = {}  # replaced wholesale; safe to read from other threads
        self.warm_up_ms: float | None = None  # the first forward, run before `ready`
        self._prefetch: list[str] = []  # sessions to page in from disk while idle, next first

    # --- called from other threads ---

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: TurnJob) -> None:
        self._inbox.put(job)

    def cancel(self, session_id: str) -> None:
        self._inbox.put(Cancel(session_id))

    def forget(self, session_id: str) -> None:
        """Drop a deleted session's cache from every tier (it must not be generating)."""
        self._inbox.put(Forget(session_id))

    def query_status(self, reply: Callable[[dict[str, Any]], None]) -> None:
        """Ask for fresh statistics: answered between steps, once any finished turn is kept (on disk too)."""
        self._inbox.put(Status(reply))

    def stop(self, timeout: float | None = None) -> None:
        """Cancel whatever runs (each job gets its Done) and end the thread."""
        self._inbox.put(Stop())
        self._thread.join(timeout)

    def statistics(self) -> EngineStatistics:
        """The turns running and waiting now: read on the engine thread, or while it is not running."""
        s = self._turns.statistics()
        turns = {sid: act.statistics() for sid, act in self._turns.running.items()}
        return EngineStatistics(running=s.running, waiting=s.waiting, prefilling=s.prefilling,
                                decoding=s.decoding, turns=turns)

    # --- the engine thread (tests drive them on their own thread, without start()) ---

    def load(self) -> None:
        """Load the model, open the caches and warm up: the first thing the engine thread does."""
        from cachestore import Budgets, SessionCaches, model_fingerprint

        from ..models.sources import prepare_model
        from .modelload import load_model, warm_up
        from .quantized import make_cache

        c = self.config
        loaded = load_model(c.model, self.model_dir or prepare_model(c.model, c.models_dir))
        if self.lockstep is not None:
            from .shard import shard

            shard(c.model, loaded, self.lockstep.group)
        kv_bits = c.kv_bits or None
        self.caches = SessionCaches(
            c.cache_dir,
            model_fingerprint(model_id=c.model, config=loaded.config, dtype=loaded.dtype, kv_bits=kv_bits,
                              fresh_cache=make_cache(loaded.model, kv_bits), rank=c.rank,
                              world_size=c.world_size),
            Budgets(resident_bytes=c.resident_bytes, warm_bytes=c.warm_bytes,
                    disk_bytes=c.disk_bytes, resident_idle=c.resident_idle,
                    warm_idle=c.warm_idle, max_segments=c.max_segments,
                    resident_sessions=c.max_resident_sessions, warm_bits=c.warm_bits,
                    block_tokens=c.block_tokens),
        )
        self.model, self.tokenizer, self.max_context = loaded.model, loaded.tokenizer, loaded.max_context
        self._new_generator()
        if self.lockstep is not None:
            self.lockstep.stream = self.generator.stream
            self.lockstep.open_doorbell()
        self.warm_up_ms = warm_up(self.model, self.tokenizer, make_cache(self.model, kv_bits))
        if self.lockstep is not None:
            import random

            import mlx.core as mx

            # Every rank samples the same tokens from the same logits: the same seed, the same draws.
            mx.random.seed(self.lockstep.share(random.getrandbits(31)))

    def _new_generator(self) -> None:
        from mlx_lm.generate import BatchGenerator

        self.generator = BatchGenerator(
            self.model,
            stop_tokens=[[t] for t in sorted(self.tokenizer.eos_token_ids)],
            prefill_step_size=self.config.prefill_step_size,
            completion_batch_size=self.config.max_generations,
        )

    def open(self) -> None:
        """Load (a failure is kept in `load_error`), plan the prefetch, publish: then `ready`."""
        try:
            self.load()
        except BaseException as e:  # reported to every client; `kvd serve` then stops (startup.py)
            log.debug("loading model %s failed", self.config.model, exc_info=True)
            self.load_error = e
        if self.caches is not None and self.config.prefetch:
            self._prefetch = self.caches.prefetch_plan()
        self._publish_stats()
        self.ready.set()

    def _run(self) -> None:
        self.open()
        ls = self.lockstep
        # Idle, rank 0 still speaks (an IDLE tick) often enough for the followers' watchdog.
        idle_wait = MAINTAIN_EVERY if ls is None else min(MAINTAIN_EVERY, ls.heartbeat)
        while True:
            try:
                if self._turns.running or self._prefetch:
                    cmd = self._inbox.get(block=False)
                else:
                    if ls is not None:
                        ls.sleep()  # the followers wait without spinning
                    cmd = self._inbox.get(timeout=idle_wait)
            except queue.Empty:
                cmd = None
            with ls.watched() if ls is not None else contextlib.nullcontext():
                if cmd is None and not self._turns.running:
                    if ls is not None:
                        ls.send(Kind.IDLE)
                    self.idle()
                if isinstance(cmd, Stop):
                    if ls is not None:
                        ls.send(cmd)
                    self.close()
                    return
                if cmd is not None:
                    if ls is not None and not isinstance(cmd, Status):
                        ls.send(cmd)
                    self.apply(cmd)
                if self._inbox.empty():  # every request so far handled: the engine moves one step
                    if ls is not None:
                        ls.send(Kind.STEP)
                    self.advance()

    # --- what rank 0's loop does, and a follower on rank 0's word (follower.py) ---

    def idle(self) -> None:
        """Upkeep while nothing runs: the next planned prefetch, else demote idle caches."""
        if self._turns.running or self.caches is None:
            return
        if self._prefetch:
            self._prefetch_one()
        else:
            self.caches.maintain()
        self._publish_stats()

    def close(self) -> None:
        """Cancel whatever runs (each job gets its Done), page every cache out, close the tiers."""
        for job in self._turns.waiting():
            self._cancel(job.session_id)
        for sid in list(self._turns.running):
            self._cancel(sid)
        if self.caches is not None:
            self.caches.page_out_all()
            self.caches.close()

    def advance(self) -> None:
        self._advance()

    def apply(self, cmd: TurnJob | Cancel | Forget | Status) -> None:
        self._handle(cmd)

    def _advance(self) -> None:
        """Start what may start, then one step of the running turns."""
        self._admit_waiting()
        if self._turns.running:
            self._step()

    def step(self) -> None:
        """Handle every request submitted so far, then run one engine step.

        What the engine thread's loop does between waits; a test calls it on
        its own thread, after `load()` and without `start()`, to drive the
        engine one deterministic step at a time.
        """
        while True:
            try:
                cmd = self._inbox.get(block=False)
            except queue.Empty:
                break
            assert not isinstance(cmd, Stop), "stop() is for a started engine"
            self._handle(cmd)
        self._advance()

    def _handle(self, cmd: TurnJob | Cancel | Forget | Status) -> None:
        if isinstance(cmd, TurnJob):
            self._start(cmd)
        elif isinstance(cmd, Cancel):
            self._cancel(cmd.session_id)
        elif isinstance(cmd, Forget):
            if self.caches is not None and cmd.session_id not in self._turns.running:
                self.caches.forget(cmd.session_id)
                self._publish_stats()
        elif isinstance(cmd, Status):
            if self.caches is not None and not cmd.written:
                # Counted once disk holds what finished turns wrote, without waiting for it here.
                again = Status(cmd.reply, written=True)
                self.caches.after_writes(lambda: self._inbox.put(again))
                return
            self._publish_stats()
            cmd.reply(self.stats)

    def _prefetch_one(self) -> None:
        """Page the next planned session into memory: only while nothing else runs.

        The lowest priority there is: a decode step or a queued job always
        goes first, and a job that arrives meanwhile waits for at most one
        session's page-in (~0.1 s for a 2k-token SmolLM2 cache). A session
        asked for before its turn in the plan is restored the usual way.
        """
        assert self.caches is not None
        key = self._prefetch.pop(0)
        try:
            if tier := self.caches.prefetch(key):
                log.debug("prefetched the cache of %s into %s", key, tier)
        except Exception:
            log.exception("prefetching the cache of %s failed; it stays on disk", key)
        if not self._prefetch:
            s = self.caches.statistics()["prefetched"]
            log.info("prefetched %d session(s) into memory (%d resident, %d warm; %d bytes)",
                     s["sessions"], s["resident"], s["warm"], s["bytes"])

    def _start(self, job: TurnJob) -> None:
        if self.load_error is not None:
            job.emit(Failed(p.INTERNAL, f"the model failed to load: {self.load_error}"))
            return
        if self._turns.holds(job.session_id):
            job.emit(Failed(p.BUSY, "this session is already generating"))
            return
        if not self._turns.has_room():
            job.emit(Queued(self._turns.wait(job.session_id, job)))
            return
        self._admit(job)

    def _admit_waiting(self) -> None:
        """Start waiting jobs while there is room; tell the rest their new places."""
        for job in self._turns.admissible():
            self._admit(job)
        for job, position in self._turns.moved():
            job.emit(Queued(position))

    def _admit(self, job: TurnJob) -> None:
        try:
            self._insert(job)
        except PromptTooLong as e:
            job.emit(Failed(p.TOO_LARGE, str(e)))
        except Exception as e:
            if self.lockstep is not None:
                self.lockstep.lost(e)
            log.exception("starting generation for %s failed", job.session_id)
            job.emit(Failed(p.INTERNAL, f"generation failed to start: {e}"))

    def _insert(self, job: TurnJob) -> None:
        from mlx_lm.sample_utils import make_sampler

        from .prefill import Prefill
        from .quantized import make_cache

        tokens, retokenized = job.tokens, job.retokenized
        if self.max_context and len(tokens) + job.max_tokens > self.max_context:
            raise PromptTooLong(
                f"the conversation ({len(tokens)} tokens) plus max_tokens ({job.max_tokens}) "
                f"exceeds the model's context of {self.max_context} tokens; "
                + fit_advice(len(tokens), self.max_context, history=job.history)
            )
        assert self.caches is not None
        out = self.caches.checkout(job.session_id, tokens)
        if self.lockstep is not None:
            out = self.lockstep.common_prefix(out)  # what every rank holds, or nothing
        if job.seed is not None:
            import mlx.core as mx

            mx.random.seed(job.seed)
        cache, cached, shared = out.cache, out.tokens, out.shared_tokens
        if cache is None or cached == 0:
            cache, cached, shared = make_cache(self.model, self.config.kv_bits or None), 0, 0
        self._turns.start(job.session_id, RunningTurn(
            job=job, detokenizer=self.tokenizer.detokenizer, prompt=tokens, cached_len=cached,
            restored_from=out.restored_from, restore_ms=out.restore_ms, inserted=time.perf_counter(),
            sampler=make_sampler(job.temperature, top_p=job.top_p if job.top_p < 1 else 0.0),
            prefill=Prefill(self.model, cache, tokens, cached, step=self.config.prefill_step_size,
                            boundary=self.caches.boundary(cache),
                            at_boundary=functools.partial(self.caches.capture, job.session_id)),
            shared_tokens=shared, prefetched=out.prefetched and cached > 0,
        ))
        job.emit(Started(prompt_tokens=len(tokens), cached_tokens=cached, retokenized=retokenized))

    def _step(self) -> None:
        """One decode step for every session in the batch, then one prefill chunk."""
        if self._turns.any_decoding():
            self._decode()
        if (sid := self._turns.next_prefill()) is not None:
            self._prefill(sid)

    def _prefill(self, session_id: str) -> None:
        import mlx.core as mx

        from .prefill import first_token

        act = self._turns.running[session_id]
        assert act.prefill is not None
        n, before = self._turns.chunk_size(), act.prefill.fed
        if self.lockstep is not None:
            n = self.lockstep.share(n)  # sized by rank 0's clock
        try:
            t0 = time.perf_counter()
            with mx.stream(self.generator.stream):
                logprobs = act.prefill.advance(n)
                if logprobs is not None and act.job.grammar is not None:
                    act.constraint = self._constraint(act.job.grammar, logprobs.shape[-1])
                    logprobs = act.constraint.mask(logprobs)
                token = first_token(logprobs, act.sampler) if logprobs is not None else None
            now = time.perf_counter()
            self._turns.chunk_fed(act.prefill.fed - before, now - t0)
            if token is None:
                if act.progress_at is None or now - act.progress_at >= PROGRESS_EVERY:
                    act.progress_at = now
                    act.job.emit(Progress(fed=act.prefill.fed, total=len(act.prefill.tokens)))
                return
        except Exception as e:
            if self.lockstep is not None:
                self.lockstep.lost(e)
            log.exception("prefill for %s failed", session_id)
            act.job.emit(Failed(p.INTERNAL, f"generation failed: {e}"))
            self._forget(session_id)
            return
        prefill, act.prefill = act.prefill, None
        self._took(act, token, time.perf_counter())
        act.first = token
        job = act.job
        if token in self.tokenizer.eos_token_ids:
            # Done before decoding: the cache holds the prompt; the stop token is neither shown nor fed.
            self._finish(act, "stop", prefill.cache, prefill.tokens)
            return
        if job.max_tokens == 1:
            # A one-token answer: shown, so part of the history, but never fed to the cache.
            self._finish(act, "length", prefill.cache, prefill.tokens, unfed=[token])
            return
        from .quantized import as_batchable

        # The first token is the sequence's one-token prompt: BatchGenerator feeds it and
        # samples on; its max_tokens counts from the second token.
        (uid,) = self.generator.insert(
            [[token]], max_tokens=[job.max_tokens - 1], caches=[as_batchable(prefill.cache)],
            all_tokens=[prefill.tokens], samplers=[act.sampler],
            logits_processors=[[act.constraint]] if act.constraint is not None else None,
        )
        act.uid = uid
        self._by_uid[uid] = session_id
        # Speculation runs on one rank only (docs/distributed.md).
        if self.config.speculate == "auto" and act.constraint is None and self.lockstep is None:
            from .draft import PromptLookup
            from .speculate import Speculation, speculable
            from .verify import Target

            if speculable(prefill.cache):
                act.spec = self._speculating[uid] = Speculation(
                    Target(job.temperature, job.top_p), PromptLookup(prior=self._answers.get(session_id)))
        self._turns.decode(session_id)

    def _constraint(self, grammar: str, width: int) -> Constraint:
        """A matcher for one answer's grammar over the model's tokens (the tokenizer's view made once)."""
        from .grammar import Constraint, tokenizer_view

        if self._grammar_view is None or self._grammar_view[0] != width:
            self._grammar_view = (width, tokenizer_view(self.tokenizer, width))
        return Constraint(self._grammar_view[1], grammar, width)

    def _decode(self) -> None:
        from . import speculate

        try:
            # A step that verifies drafts where some session has one; a plain step otherwise.
            responses = speculate.step(self.generator, self._speculating) if self._speculating else None
            if responses is None:
                _, responses = self.generator.next()
        except Exception as e:
            if self.lockstep is not None:
                self.lockstep.lost(e)  # a dead rank, or ranks no longer in step
            # The batch is in an unknown state: fail everyone in it, start afresh.
            log.exception("generation step failed")
            for sid in list(self._by_uid.values()):
                self._turns.running[sid].job.emit(Failed(p.INTERNAL, f"generation failed: {e}"))
                self._forget(sid)
            self._new_generator()
            return
        now = time.perf_counter()
        for r in responses:
            owner = self._by_uid.get(r.uid)
            if owner is None:
                continue
            act = self._turns.running[owner]
            self._took(act, r.token, now, shown=r.finish_reason != "stop")
            if r.finish_reason is not None:
                self._finish(act, r.finish_reason, r.prompt_cache, list(r.all_tokens))

    def _took(self, act: RunningTurn, token: int, now: float, *, shown: bool = True) -> None:
        act.took(token, now, shown=shown and token not in self.tokenizer.eos_token_ids)  # a stop token never shows

    def _cancel(self, session_id: str) -> None:
        job = self._turns.withdraw(session_id)
        if job is not None:
            job.emit(Done("cancelled", RunningTurn.never_started(job).usage(self.max_context), None))
            return
        act = self._turns.running.get(session_id)
        if act is None:
            return
        if act.prefill is not None:
            # Keep what was prefilled for next time; the fed ids stay as they were.
            pre = act.prefill
            self._finish(act, "cancelled", pre.cache if pre.fed else None, pre.tokens[:pre.fed],
                         changed=False)
            return
        removed = self.generator.remove([act.uid], return_prompt_caches=True)
        cache, tokens = removed.get(act.uid, (None, []))
        tokens = list(tokens)
        # Cancelled before the first decode step fed the first token: it was shown, so it
        # belongs to the history, but the cache ends with the prompt.
        unfed = [act.first] if act.first is not None and len(tokens) == len(act.prompt) else []
        self._finish(act, "cancelled", cache, tokens, unfed=unfed)

    def _finish(self, act: RunningTurn, reason: str, cache: list[Any] | None, tokens: list[int],
                *, changed: bool = True, unfed: Sequence[int] = ()) -> None:
        """Send the end of the answer, then keep the cache (which holds `tokens`).

        `unfed`: answer tokens after `tokens` that were shown but never fed; the session's
        history (`Done.tokens`) includes them, the cache does not, so the next turn feeds
        them first. `changed` is False when the session's fed ids stay as they were
        (nothing was generated).
        """
        act.detokenizer.finalize()
        if text := act.detokenizer.last_segment:
            act.job.emit(Delta(text))
        sid = act.job.session_id
        self._forget(sid)
        history = [*tokens, *unfed]
        if changed and len(history) > len(act.prompt):
            self._answers.keep(sid, history[len(act.prompt):])
        act.job.emit(Done(reason, act.usage(self.max_context), history if tokens and changed else None))
        # Behind the turn: the client has its answer; now keep the cache and hand the snapshot of
        # its new tokens to the I/O worker (this thread only evaluates it; it never waits on disk).
        if cache is not None and tokens and self.caches is not None:
            try:
                self.caches.checkin(sid, cache, tokens)
            except Exception:
                log.exception("keeping the cache of %s failed; it will prefill next time", sid)
        self._publish_stats()

    def _forget(self, session_id: str) -> None:
        act = self._turns.end(session_id)
        if act is not None and act.uid is not None:
            self._by_uid.pop(act.uid, None)
            self._speculating.pop(act.uid, None)

    def _publish_stats(self) -> None:
        caches = self.caches.statistics() if self.caches is not None else {}
        where = self.caches.locations() if self.caches is not None else {}
        s = self.statistics()
        self.stats = {"generating": s.running, "waiting": s.waiting,
                      "answering": {sid: asdict(turn) for sid, turn in s.turns.items()},
                      "prefetched": caches.pop("prefetched", {}), "tiers": caches, "locations": where,
                      "warm_up_ms": self.warm_up_ms}
        if (ls := self.lockstep) is not None:  # the control channel's traffic, from this rank's side
            self.stats["ranks"] = {"world_size": ls.size, "messages": ls.messages, "bytes": ls.bytes}

