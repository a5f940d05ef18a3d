"""What one engine step does to the answers: admit, prefill a chunk, decode the batch, finish, cancel.

The engine thread (thread.py) owns the loop, the inbox, the model's loading
and the statistics; once the model is loaded it makes one `Steps`, which
moves the answers along, and calls it. `Steps` owns the decode batch
(decode.py), the recent answers speculation drafts from, and the grammar
view; the scheduler and its list of answers are the engine's, handed in (the
engine reads it for its statistics and its idle waits). Everything here runs
on the engine thread.

An answer (running.py) is in one phase (scheduler.py). Waiting: no room yet.
Restoring: admitted, its cache checked out; a cache on disk is read by the
I/O worker, and the answer holds the pending read until the reader reports
its end (`read_reported`). Prefilling: the session's restored cache is fed
the rest of its prompt a chunk per step (prefill.py), first come first
served, and the last chunk's logits give the first token (held to the
answer's grammar, if it has one: grammar.py). Decoding: its row joins kvd's
decode batch (decode.py) with that token, fed first, and its cache; the
cache comes back out of the finished or removed row. An answer may carry a
request's other choices (n > 1, `Answer.choices`): they are admitted with it
and ride on it until its prompt is read; then each draws its own first token
from the same last logits and decodes in a row of its own, from a copy of
the prompt's cache (`_firsts`). Each step runs one
decode step for every row in the batch, then one prefill chunk, so a long
prefill never freezes the others.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import protocol as p
from cachestore import Abandoned

from ..config import Config
from ..events import AnswerError, AnswerProgress, AnswerQueued
from .draft import Answers
from .jobs import Done, PromptTooLong
from .logprobs import pick, records
from .processing import processing
from .running import Answer, detokenizer_for, fit_advice
from .scheduler import Phase, Scheduler

if TYPE_CHECKING:
    from cachestore import Checkout, SessionCaches

    from .draws import Draws
    from .grammar import Constraint
    from .handoff import Handoff
    from .lockstep import Lockstep
    from .prefill import Prefill
    from .profile import StepProfile


log = logging.getLogger("kvd.engine")

# The most the engine waits, after an answer's first token, for the event loop to have sent it
# (Answer.handed): on a 2-core machine the next step (the answer's own decode, its finish, another
# session's) took a core and the GIL from the loop and held the first token back 1-12 ms; handed
# over, it leaves ~1 ms after it is sampled. Bounded, so a stalled loop costs the others little.
FIRST_HANDOFF_S = 0.01
PROGRESS_EVERY = 0.25  # seconds between AnswerProgress events of one prefill: a few a second is enough to watch


class Steps:
    """Moves the answers along, one engine step at a time: made by the engine once its model is loaded."""

    def __init__(self, config: Config, model: Any, tokenizer: Any, caches: SessionCaches, *,
                 scheduler: Scheduler[Answer], lockstep: Lockstep | None, max_context: int | None,
                 publish: Callable[[], None], out: Handoff, profile: StepProfile | None = None):
        """`scheduler`: the engine's, with its list of answers; `publish`: the engine's statistics
        for other threads, refreshed after an answer's cache is kept; `out`: the engine's hand-off of
        the answers' events to the event loop (flushed by the engine after each step); `profile`: the
        step profiler, when it is on (profile.py)."""
        import mlx.core as mx

        from .decode import Decoder

        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.caches: SessionCaches | None = caches
        self.lockstep = lockstep
        self.max_context = max_context
        self.scheduler = scheduler
        self._publish_stats = publish
        self.out = out
        self.stream = mx.new_stream(mx.default_device())  # the engine's own: every prefill chunk and decode step
        self.decoder = Decoder(model, self.stream)
        self.profile = self.decoder.prof = profile
        self._last_answers = Answers()  # recent sessions' last answers: a regenerate drafts from the one it replaces
        self._grammar_view: tuple[int, Any] | None = None  # llguidance's view of the tokenizer, once asked for
        self.last: Any | None = None  # the model for a prompt's last chunk (prefill.last_position), after warm-up
        #: The bytes a live cache of n ids takes (the cache store's, once the engine connected it to the model).
        self.cost: Callable[[int], int] = lambda n: 0

    # --- what the engine calls ---

    def start(self, a: Answer) -> None:
        """A new answer: it starts, waits, or is refused (its session is busy)."""
        if self.scheduler.holds(a.session_id):
            a.refuse(AnswerError(p.BUSY, "this session is already generating"))
            return
        a.need = self._need(a)
        # First come, first served: nobody overtakes a waiting answer.
        if self.scheduler.phase(Phase.WAITING) or not self.scheduler.has_room(a.need, a.key, a.rows):
            a.tell(AnswerQueued(self.scheduler.wait(a)))
            return
        self._admit(a)

    def _need(self, a: Answer) -> int:
        """The bytes the answer's cache may reach: its prompt plus max_tokens (cachestore/cost.py), once for
        each of its rows (the choices riding on it decode from copies of its cache)."""
        return self.cost(len(a.tokens) + a.max_tokens) * a.rows

    def admit_waiting(self) -> None:
        """Start waiting answers while there is room; tell the rest their new places."""
        for a in self.scheduler.admissible():
            self._admit(a)
        for a in self.scheduler.moved():
            a.tell(AnswerQueued(a.told))

    def _admit(self, a: Answer) -> None:
        if self.scheduler.alone(a.need):
            log.info("the cache of %s may reach %d MiB, more than cache.resident_bytes (%d MiB): it runs "
                     "alone", a.session_id, a.need >> 20, (self.scheduler.budget or 0) >> 20)
        self.scheduler.admit(a)
        try:
            self._insert(a)
        except PromptTooLong as e:
            self.scheduler.end(a.session_id)
            a.refuse(AnswerError(p.TOO_LARGE, str(e)))
        except Exception as e:
            self.scheduler.end(a.session_id)
            if self.lockstep is not None:
                self.lockstep.lost(e)
            log.exception("starting generation for %s failed", a.session_id)
            a.refuse(AnswerError(p.INTERNAL, f"generation failed to start: {e}"))

    def read_reported(self) -> None:
        """The I/O worker's reader reported on a read: start the answers whose read has ended (their
        reads were planned in `_insert`; a cancelled answer's read was abandoned with it)."""
        if self.caches is None:
            return
        for a in self.scheduler.phase(Phase.RESTORING):
            if a.read is None or (out := self.caches.restored(a.read)) is None:
                continue
            a.read = None
            try:
                self._begin(a, out)
            except Exception as e:
                self.scheduler.end(a.key)
                log.exception("starting generation for %s failed", a.key)
                a.refuse(AnswerError(p.INTERNAL, f"generation failed to start: {e}"))

    def _insert(self, a: Answer) -> None:
        tokens = a.tokens
        if self.max_context and len(tokens) + a.max_tokens > self.max_context:
            raise PromptTooLong(
                f"the conversation ({len(tokens)} tokens) plus max_tokens ({a.max_tokens}) "
                f"exceeds the model's context of {self.max_context} tokens; "
                + fit_advice(len(tokens), self.max_context, history=a.history)
            )
        assert self.caches is not None
        # The engine does not wait for a read: a cache on disk is read by the I/O worker and the answer
        # starts when the read has ended (`read_reported`); ranks in lockstep wait, to stay in step.
        # An answer that wants every prompt position's logits (prompt_logprobs) reads its prompt whole: it asks
        # for one id, so the store still makes room, and drops what that restores (`_begin`).
        wanted = tokens[:1] if a.prompt_logprobs else tokens
        out = self.caches.checkout(a.session_id, wanted, wait=self.lockstep is not None)
        if out.read is not None:
            a.read = out.read  # it stays restoring
            return
        self._begin(a, out)

    def _begin(self, a: Answer, out: Checkout) -> None:
        """Start an answer from its checked-out cache: its prompt is fed next."""
        from .prefill import Prefill
        from .quantized import make_cache

        assert self.caches is not None
        tokens = a.tokens
        if self.lockstep is not None:
            out = self.lockstep.common_prefix(out)  # what every rank holds, or nothing
        cache, cached, shared = out.cache, out.tokens, out.shared_tokens
        if a.prompt_logprobs:
            out = replace(out, restored_from=p.NO_CACHE, restore_ms=0.0, prefetched=False)
        if cache is None or cached == 0 or a.prompt_logprobs:
            cache, cached, shared = make_cache(self.model, self.config.kv_bits or None), 0, 0
        a.detokenizer, a.prompt, a.cached_len = detokenizer_for(self.tokenizer, raw=a.raw), tokens, cached
        a.restored_from, a.restore_ms, a.inserted = out.restored_from, out.restore_ms, time.perf_counter()
        a.draws, a.processing = self._draws(a), processing(a.sampling)
        boundary, at_boundary = self.caches.windows(a.session_id, cache) or (None, None)
        a.prefill = Prefill(self.model, cache, tokens, cached, step=self.config.prefill_step_size,
                            boundary=boundary, at_boundary=at_boundary, last=self.last,
                            collect=(a.logprobs or 0) if a.prompt_logprobs else None, raw=a.processing is not None)
        a.shared_tokens, a.prefetched = shared, out.prefetched and cached > 0
        a.checkpoint = out.checkpoint and cached > 0
        self.scheduler.prefill(a)

    @staticmethod
    def _draws(a: Answer) -> Draws:
        """How the answer draws its tokens: its own seed's keys, one per answer position (draws.py)."""
        from .draws import Draws
        from .speculate import POSITION_BUDGET

        return Draws(a.temperature, a.top_p, seed=a.seed, size=a.max_tokens + POSITION_BUDGET,
                     top_k=a.sampling.top_k or 0, min_p=a.sampling.min_p or 0.0)

    def step(self) -> None:
        """One decode step for every row in the batch, then one prefill chunk."""
        if self.scheduler.any_decoding():
            self._decode()
            if self.profile is not None:
                self.profile.lap("books")
        if (a := self.scheduler.next_prefill()) is not None:
            self.out.flush(force=True)  # the text held back leaves before a chunk that may take long
            self._prefill(a)
            if self.profile is not None:
                self.profile.lap("prefill")

    def _prefill(self, answer: Answer) -> None:
        import mlx.core as mx

        session_id = answer.key
        pre = answer.prefill
        assert pre is not None
        n, before = self.scheduler.chunk_size(), pre.fed
        if self.lockstep is not None:
            n = self.lockstep.share(n)  # sized by rank 0's clock
        try:
            t0 = time.perf_counter()
            with mx.stream(self.stream):
                last = pre.advance(n)
                firsts = self._firsts(answer, pre, last) if last is not None else None
            now = time.perf_counter()
            self.scheduler.chunk_fed(pre.fed - before, now - t0)
            if firsts is None:
                if answer.progress_at is None or now - answer.progress_at >= PROGRESS_EVERY:
                    answer.progress_at = now
                    answer.tell(AnswerProgress(fed=pre.fed, total=len(pre.tokens)))
                return
            # Each other choice decodes from a copy of the prompt's cache (mlx-lm's own way to fork one).
            caches = [pre.cache, *(copy.deepcopy(pre.cache) for _ in answer.choices)]
        except Exception as e:
            if self.lockstep is not None:
                self.lockstep.lost(e)
            log.exception("prefill for %s failed", session_id)
            answer.refuse(AnswerError(p.INTERNAL, f"generation failed: {e}"))
            self._end(session_id)
            return
        answer.prefill, choices, answer.choices = None, answer.choices, []
        for m in choices:  # answers of their own from here on, their bytes held by each
            m.need = self._need(m)
        answer.need = self._need(answer)
        now = time.perf_counter()
        shown = [self._took(m, token, now) for m, token in firsts]
        if shown[0] and answer.handed is not None:
            self.out.flush(force=True)
            answer.handed.wait(FIRST_HANDOFF_S)  # the first token out before the next step (see there)
        for (m, token), cache in zip(firsts, caches):
            self._started(m, token, pre.tokens, cache)

    def _firsts(self, lead: Answer, pre: Prefill, last: Any) -> list[tuple[Answer, int]]:
        """The first token of the answer and of each choice riding on it, from the prompt's last logits
        (`last`): the choices start here, from the answer's read prompt, each drawing with its own keys."""
        out = []
        for m in lead.members:
            if m is not lead:
                m.forked(lead)
                m.detokenizer = detokenizer_for(self.tokenizer, raw=m.raw)
                m.draws, m.processing = self._draws(m), processing(m.sampling)
            out.append((m, self._first(m, pre, last)))
        return out

    def _first(self, a: Answer, pre: Prefill, last: Any) -> int:
        """One answer's first token: its processors (the prefill then gave raw logits) and its grammar applied
        to the prompt's last logits, drawn with its first key; its log-probabilities kept, where asked."""
        import mlx.core as mx

        from .prefill import first_token

        logprobs = last
        if pre.raw:
            logits = a.processing.apply(pre.tokens, last) if a.processing is not None else last
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if a.grammar is not None:
            a.constraint = self._constraint(a.grammar, logprobs.shape[-1])
            logprobs = a.constraint.mask(logprobs)
        assert a.draws is not None
        token = first_token(logprobs, a.draws.take)
        if a.logprobs is not None:
            a.token_logprobs += records([token], pick(logprobs, mx.array([token]), a.logprobs))
            a.prompt_token_logprobs = pre.prompt_logprobs()
        return token

    def _started(self, answer: Answer, token: int, prompt: list[int], cache: list[Any]) -> None:
        """An answer's first token is drawn (and said): it ends there, or decodes on from `cache` (which
        holds `prompt`)."""
        session_id = answer.key
        if token in self.tokenizer.eos_token_ids:
            # Done before decoding: the cache holds the prompt; the stop token is neither shown nor fed.
            self._finish(answer, "stop", cache, list(prompt))
            return
        if answer.max_tokens == 1:
            # A one-token answer: shown, so part of the history, but never fed to the cache.
            self._finish(answer, "length", cache, list(prompt), unfed=[token])
            return
        from .decode import Row

        # Speculation runs on one rank only (docs/distributed.md).
        if (self.config.speculate == "auto" and answer.constraint is None and answer.logprobs is None
                and answer.processing is None and self.lockstep is None):
            from .draft import PromptLookup
            from .speculate import Speculation, speculable

            if speculable(cache):
                answer.spec = Speculation(PromptLookup(prior=self._last_answers.get(session_id)))
        # The next decode step feeds the first token; the row's max_tokens counts from the second token.
        assert answer.draws is not None
        answer.row = Row(session_id, list(prompt), answer.draws, answer.max_tokens - 1,
                      frozenset(self.tokenizer.eos_token_ids), answer.constraint, answer.spec,
                      cache=cache, first=token,  # it enters the batch at the next decode step
                      logprobs=answer.logprobs, processing=answer.processing)
        self.scheduler.decode(answer)
        if self.profile is not None:
            answer.profiled = self.profile.mark()  # its decode steps' profile starts at the next one

    def _constraint(self, grammar: str, width: int) -> Constraint:
        """A matcher for one answer's grammar over the model's tokens (the tokenizer's view made once)."""
        from .grammar import Constraint, tokenizer_view

        if self._grammar_view is None or self._grammar_view[0] != width:
            self._grammar_view = (width, tokenizer_view(self.tokenizer, width))
        return Constraint(self._grammar_view[1], grammar, width)

    def _decode(self) -> None:
        decoding = self.scheduler.phase(Phase.DECODING)
        try:
            out = self.decoder.step([a.row for a in decoding if a.row is not None and a.row.entering])
        except Exception as e:
            if self.lockstep is not None:
                self.lockstep.lost(e)  # a dead rank, or ranks no longer in step
            # The batch is in an unknown state: fail every answer in it, start afresh.
            log.exception("generation step failed")
            for a in decoding:
                a.tell(AnswerError(p.INTERNAL, f"generation failed: {e}"))
                self._end(a.key)
            self.decoder.reset()
            return
        now = time.perf_counter()
        answers = {a.key: a for a in decoding}
        for r in out:
            answer = answers[r.key]
            self._took(answer, r.token, now, shown=r.finish != "stop")
            if r.picked is not None and r.finish != "stop":
                answer.token_logprobs += records([r.token], r.picked)
            if r.finish is not None:
                self._finish(answer, r.finish, r.cache, list(r.tokens or ()))

    def _took(self, answer: Answer, token: int, now: float, *, shown: bool = True) -> bool:
        """Whether a delta went out; a stop token never shows."""
        return answer.took(token, now, shown=shown and token not in self.tokenizer.eos_token_ids)

    def cancel(self, session_id: str) -> None:
        """End the session's answer, in whatever phase, with a cancelled Done."""
        a = self.scheduler.get(session_id)
        if a is None:
            self._cancel_choice(session_id)
            return
        match a.phase:
            case Phase.WAITING | Phase.RESTORING:  # never started: nothing to keep
                self.scheduler.end(session_id)
                if a.read is not None and self.caches is not None:
                    self.caches.tell(Abandoned(a.read))
                a.never_started(self.max_context)
            case Phase.PREFILLING:
                # Keep what was prefilled for next time; the fed ids stay as they were.
                pre = a.prefill
                assert pre is not None
                choices, a.choices = a.choices, []
                self._finish(a, "cancelled", pre.cache if pre.fed else None, pre.tokens[:pre.fed], changed=False)
                for c in choices:
                    c.never_started(self.max_context)
            case Phase.DECODING:
                assert a.row is not None
                cache, tokens, unfed = self.decoder.remove(a.row)
                # Cancelled before the decode step that feeds the first token: it was shown, so it
                # belongs to the history, but the cache ends with the prompt.
                self._finish(a, "cancelled", cache, list(tokens), unfed=unfed)

    def _cancel_choice(self, session_id: str) -> None:
        """A choice still riding on its answer (its prompt not read yet) ends alone: the others go on."""
        for a in self.scheduler.answers:
            for c in a.choices:
                if c.key == session_id:
                    a.choices.remove(c)
                    a.need = self._need(a)
                    c.never_started(self.max_context)
                    return

    def _finish(self, answer: Answer, reason: str, cache: list[Any] | None, tokens: list[int],
                *, changed: bool = True, unfed: Sequence[int] = ()) -> None:
        """Send the end of the answer, then keep the cache (which holds `tokens`).

        `unfed`: answer tokens after `tokens` that were shown but never fed; the session's
        history (`Done.tokens`) includes them, the cache does not, so the next turn feeds
        them first. `changed` is False when the session's fed ids stay as they were
        (nothing was generated).
        """
        answer.detokenizer.finalize()
        if text := answer.detokenizer.last_segment:
            answer.say(text)
        sid = answer.session_id
        self._end(sid)
        if self.profile is not None and answer.profiled is not None:
            log.info("profile of %s: %s", sid, self.profile.summary(answer.profiled, answer.generated - 1))
        history = [*tokens, *unfed]
        if changed and len(history) > len(answer.prompt):
            self._last_answers.keep(sid, history[len(answer.prompt):])
        failure = answer.constraint.failure if answer.constraint is not None and reason != "cancelled" else None
        if failure is not None:  # ended because it left its grammar: not JSON, so never a normal finish
            answer.tell(AnswerError(p.INTERNAL, f"the answer could not be held to its response_format ({failure}); "
                                "try a simpler schema"))
        else:
            answer.tell(Done(reason, answer.usage(self.max_context), history if tokens and changed else None,
                             logprobs=tuple(answer.token_logprobs) if answer.logprobs is not None else None,
                             prompt_logprobs=tuple(answer.prompt_token_logprobs) if answer.prompt_logprobs else None))
        # Behind the turn: the client has its answer; now keep the cache and hand the snapshot of
        # its new tokens to the I/O worker (this thread only evaluates it; it never waits on disk).
        if cache is not None and tokens and self.caches is not None:
            try:
                self.caches.checkin(sid, cache, tokens)
            except Exception:
                log.exception("keeping the cache of %s failed; it will prefill next time", sid)
        self._publish_stats()

    def _end(self, session_id: str) -> None:
        self.scheduler.end(session_id)
