"""What one engine step does to the turns: admit, prefill a chunk, decode the batch, finish, cancel.

The engine thread (thread.py) owns the loop, the inbox, the model's loading
and the statistics; once the model is loaded it makes one `TurnSteps`, which
moves the turns along, and calls it. `TurnSteps` owns the decode batch
(decode.py), the recent answers speculation drafts from, and the grammar
view; the scheduler's register of turns is the engine's, handed in (the
engine reads it for its statistics and its idle waits). Everything here runs
on the engine thread.

A turn has two phases. Prefill: the session's restored cache is fed the rest
of its prompt a chunk per step (prefill.py), first come first served, and the
last chunk's logits give the first token (held to the answer's grammar, if
it has one: grammar.py). Decode: the session joins kvd's decode batch
(decode.py) with that token, fed first, and its cache; the cache comes back
out of the finished or removed row. Each step runs one decode step for every
session in the batch, then one prefill chunk, so a long prefill never
freezes the others.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import protocol as p

from ..config import Config
from .draft import Answers
from .jobs import Delta, Done, Failed, Progress, PromptTooLong, Queued, Started, TurnJob
from .running import RunningTurn, fit_advice
from .scheduler import Scheduler

if TYPE_CHECKING:
    from cachestore import CacheCost, Checkout, SessionCaches

    from .grammar import Constraint
    from .lockstep import Lockstep


log = logging.getLogger("kvd.engine")

# The most the engine waits, after a turn's first token, for the event loop to have sent it
# (TurnJob.handed): on a 2-core machine the next step (the turn's own decode, its finish, another
# session's) took a core and the GIL from the loop and held the first token back 1-12 ms; handed
# over, it leaves ~1 ms after it is sampled. Bounded, so a stalled loop costs the others little.
FIRST_HANDOFF_S = 0.01
PROGRESS_EVERY = 0.25  # seconds between Progress events of one prefill: a few a second is enough to watch


class TurnSteps:
    """Moves the turns along, one engine step at a time: made by the engine once its model is loaded."""

    def __init__(self, config: Config, model: Any, tokenizer: Any, caches: SessionCaches, *,
                 turns: Scheduler[TurnJob, RunningTurn], lockstep: Lockstep | None, max_context: int | None,
                 publish: Callable[[], None]):
        """`turns`: the engine's register of running and waiting turns; `publish`: the engine's
        statistics for other threads, refreshed after a turn is kept."""
        from .decode import Decoder

        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.caches: SessionCaches | None = caches
        self.lockstep = lockstep
        self.max_context = max_context
        self._turns = turns
        self._publish_stats = publish
        self.decoder = Decoder(model)
        self._answers = Answers()  # recent sessions' last answers: a regenerate drafts from the one it replaces
        self._grammar_view: tuple[int, Any] | None = None  # llguidance's view of the tokenizer, once asked for
        self.cost: CacheCost | None = None  # a cache's bytes by its length (the engine sets it after warm-up)
        self.last: Any | None = None  # the model for a prompt's last chunk (prefill.last_position), after warm-up

    # --- what the engine calls ---

    def start(self, job: TurnJob) -> None:
        """A new job: start it, queue it, or refuse it (its session is busy)."""
        if self._turns.holds(job.session_id):
            job.emit(Failed(p.BUSY, "this session is already generating"))
            return
        need = self._need(job)
        if not self._turns.has_room(need) or self._turns.waiting():  # first come, first served
            job.emit(Queued(self._turns.wait(job.session_id, job, need)))
            return
        self._admit(job)

    def _need(self, job: TurnJob) -> int:
        """The bytes the turn's cache may reach: its prompt plus max_tokens (cachestore/cost.py)."""
        return self.cost(len(job.tokens) + job.max_tokens) if self.cost is not None else 0

    def admit_waiting(self) -> None:
        """Start the turns whose cache was read from disk, then waiting jobs while there is room;
        tell the rest their new places."""
        self._restored()
        for job in self._turns.admissible():
            self._admit(job)
        for job, position in self._turns.moved():
            job.emit(Queued(position))

    def _admit(self, job: TurnJob) -> None:
        need = self._need(job)
        if self._turns.alone(need):
            log.info("the cache of %s may reach %d MiB, more than cache.resident_bytes (%d MiB): it runs "
                     "alone", job.session_id, need >> 20, (self._turns.budget or 0) >> 20)
        self._turns.admit(job.session_id, need)
        try:
            self._insert(job)
        except PromptTooLong as e:
            self._turns.end(job.session_id)
            job.emit(Failed(p.TOO_LARGE, str(e)))
        except Exception as e:
            self._turns.end(job.session_id)
            if self.lockstep is not None:
                self.lockstep.lost(e)
            log.exception("starting generation for %s failed", job.session_id)
            job.emit(Failed(p.INTERNAL, f"generation failed to start: {e}"))

    def _restored(self) -> None:
        """Start the turns whose cache the I/O worker has read since (their reads were planned in
        `_insert`); a turn cancelled meanwhile has left the scheduler, and its read is dropped."""
        if self.caches is None:
            return
        for sid, out in self.caches.restored(others=bool(self._turns.running)):
            job = self._turns.restored(sid)
            if job is None:
                continue
            try:
                self._begin(job, out)
            except Exception as e:
                self._turns.end(sid)
                log.exception("starting generation for %s failed", sid)
                job.emit(Failed(p.INTERNAL, f"generation failed to start: {e}"))

    def _cancel_restoring(self, session_id: str) -> bool:
        """Cancel a turn waiting for its cache's read; False if the session has none."""
        job = self._turns.restored(session_id)
        if job is None:
            return False
        self._turns.end(session_id)
        if self.caches is not None:
            self.caches.abandon(session_id)
        job.emit(Done("cancelled", RunningTurn.never_started(job).usage(self.max_context), None))
        return True

    def _insert(self, job: TurnJob) -> None:
        tokens = job.tokens
        if self.max_context and len(tokens) + job.max_tokens > self.max_context:
            raise PromptTooLong(
                f"the conversation ({len(tokens)} tokens) plus max_tokens ({job.max_tokens}) "
                f"exceeds the model's context of {self.max_context} tokens; "
                + fit_advice(len(tokens), self.max_context, history=job.history)
            )
        assert self.caches is not None
        # The engine never waits for disk: a cache on disk is read by the I/O worker and the turn
        # starts when the read reports (`_restored`); ranks in lockstep wait, to stay in step.
        out = self.caches.checkout(job.session_id, tokens, wait=self.lockstep is not None)
        self.caches.make_room()  # idle caches leave memory for what the admitted turns may reach
        if out.reading:
            self._turns.restoring(job.session_id, job)
            return
        self._begin(job, out)

    def _begin(self, job: TurnJob, out: Checkout) -> None:
        """Start a turn from its checked-out cache: its prompt is fed next."""
        from .draws import Draws
        from .prefill import Prefill
        from .quantized import make_cache
        from .speculate import POSITION_BUDGET

        assert self.caches is not None
        tokens, retokenized = job.tokens, job.retokenized
        if self.lockstep is not None:
            out = self.lockstep.common_prefix(out)  # what every rank holds, or nothing
        cache, cached, shared = out.cache, out.tokens, out.shared_tokens
        if cache is None or cached == 0:
            cache, cached, shared = make_cache(self.model, self.config.kv_bits or None), 0, 0
        self._turns.start(job.session_id, RunningTurn(
            job=job, detokenizer=self.tokenizer.detokenizer, prompt=tokens, cached_len=cached,
            restored_from=out.restored_from, restore_ms=out.restore_ms, inserted=time.perf_counter(),
            draws=Draws(job.temperature, job.top_p, seed=job.seed, size=job.max_tokens + POSITION_BUDGET),
            prefill=Prefill(self.model, cache, tokens, cached, step=self.config.prefill_step_size,
                            boundary=self.caches.boundary(cache),
                            at_boundary=functools.partial(self.caches.capture, job.session_id),
                            last=self.last),
            shared_tokens=shared, prefetched=out.prefetched and cached > 0,
        ))
        job.emit(Started(prompt_tokens=len(tokens), cached_tokens=cached, retokenized=retokenized))

    def step(self) -> None:
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
            with mx.stream(self.decoder.stream):
                logprobs = act.prefill.advance(n)
                if logprobs is not None and act.job.grammar is not None:
                    act.constraint = self._constraint(act.job.grammar, logprobs.shape[-1])
                    logprobs = act.constraint.mask(logprobs)
                draws = act.draws
                assert draws is not None
                token = first_token(logprobs, draws.take) if logprobs is not None else None
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
        job = act.job
        if self._took(act, token, time.perf_counter()) and job.handed is not None:
            job.handed.wait(FIRST_HANDOFF_S)  # the first token out before the next step (see there)
        if token in self.tokenizer.eos_token_ids:
            # Done before decoding: the cache holds the prompt; the stop token is neither shown nor fed.
            self._finish(act, "stop", prefill.cache, prefill.tokens)
            return
        if job.max_tokens == 1:
            # A one-token answer: shown, so part of the history, but never fed to the cache.
            self._finish(act, "length", prefill.cache, prefill.tokens, unfed=[token])
            return
        from .decode import Row

        # Speculation runs on one rank only (docs/distributed.md).
        if self.config.speculate == "auto" and act.constraint is None and self.lockstep is None:
            from .draft import PromptLookup
            from .speculate import Speculation, speculable

            if speculable(prefill.cache):
                act.spec = Speculation(PromptLookup(prior=self._answers.get(session_id)))
        # The next decode step feeds the first token; the row's max_tokens counts from the second token.
        assert act.draws is not None
        self.decoder.join(Row(session_id, list(prefill.tokens), act.draws, job.max_tokens - 1,
                              frozenset(self.tokenizer.eos_token_ids), act.constraint, act.spec),
                          prefill.cache, token)
        self._turns.decode(session_id)

    def _constraint(self, grammar: str, width: int) -> Constraint:
        """A matcher for one answer's grammar over the model's tokens (the tokenizer's view made once)."""
        from .grammar import Constraint, tokenizer_view

        if self._grammar_view is None or self._grammar_view[0] != width:
            self._grammar_view = (width, tokenizer_view(self.tokenizer, width))
        return Constraint(self._grammar_view[1], grammar, width)

    def _decode(self) -> None:
        try:
            out = self.decoder.step()
        except Exception as e:
            if self.lockstep is not None:
                self.lockstep.lost(e)  # a dead rank, or ranks no longer in step
            # The batch is in an unknown state: fail everyone in it, start afresh.
            log.exception("generation step failed")
            for sid in self.decoder.keys():
                self._turns.running[sid].job.emit(Failed(p.INTERNAL, f"generation failed: {e}"))
                self._forget(sid)
            self.decoder.reset()
            return
        now = time.perf_counter()
        for r in out:
            act = self._turns.running[r.key]
            self._took(act, r.token, now, shown=r.finish != "stop")
            if r.finish is not None:
                self._finish(act, r.finish, r.cache, list(r.tokens or ()))

    def _took(self, act: RunningTurn, token: int, now: float, *, shown: bool = True) -> bool:
        """Whether a delta went out; a stop token never shows."""
        return act.took(token, now, shown=shown and token not in self.tokenizer.eos_token_ids)

    def cancel(self, session_id: str) -> None:
        if self._cancel_restoring(session_id):
            return
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
        cache, tokens, unfed = self.decoder.remove(session_id)
        # Cancelled before the decode step that feeds the first token: it was shown, so it
        # belongs to the history, but the cache ends with the prompt.
        self._finish(act, "cancelled", cache, list(tokens), unfed=unfed)

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
        failure = act.constraint.failure if act.constraint is not None and reason != "cancelled" else None
        if failure is not None:  # ended because it left its grammar: not JSON, so never a normal finish
            act.job.emit(Failed(p.INTERNAL, f"the answer could not be held to its response_format ({failure}); "
                                "try a simpler schema"))
        else:
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
        self._turns.end(session_id)
