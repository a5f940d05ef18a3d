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

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import protocol as p

from .config import Config

if TYPE_CHECKING:
    from cachestore.manager import SessionCaches

    from .prefill import Prefill

log = logging.getLogger("kvd.engine")


# --- jobs in ---------------------------------------------------------------


class Prompt(Protocol):
    """How a turn's prompt ids are made; the turn core (turns.py) owns the rule."""

    def ids(self, tokenizer: Any) -> tuple[list[int], bool]:
        """The prompt's token ids, and whether the session's fed ids were rebuilt rather than appended to.

        Called on the engine thread, where the tokenizer lives.
        """
        ...

    @property
    def fed_before(self) -> int:
        """How many ids the session had fed in earlier turns (what a re-read is counted against)."""
        ...


@dataclass
class GenerationJob:
    session_id: str
    prompt: Prompt
    max_tokens: int
    temperature: float
    top_p: float
    emit: Callable[[EngineEvent], None]  # called on the engine thread; must not block
    # Start from a copy of this session's cache instead of taking the session's own
    # (a conversation that branches from a stored one; the source is left as it was).
    source: str | None = None
    seed: int | None = None  # seeds MLX's sampler when the turn starts
    arrived: float = field(default_factory=time.perf_counter)


@dataclass
class _Cancel:
    session_id: str


@dataclass
class _Forget:
    session_id: str


@dataclass
class _Stop:
    pass


@dataclass
class _Status:
    reply: Callable[[dict[str, Any]], None]  # called on the engine thread


# --- events out ------------------------------------------------------------


@dataclass
class Started:
    prompt_tokens: int
    cached_tokens: int
    retokenized: bool  # the fed ids were rebuilt from the transcript, not appended to


@dataclass
class Queued:
    position: int  # 1: the next to start; sent again whenever it moves up


@dataclass
class Progress:
    """How far a long prefill has got: sent after its first chunk, then at most every PROGRESS_EVERY."""

    fed: int  # prompt tokens in the cache now (restored ones included)
    total: int  # prompt tokens in all


@dataclass
class Delta:
    text: str


@dataclass
class Done:
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: dict[str, Any]
    tokens: list[int] | None  # every id the session's cache now holds; None: unchanged


@dataclass
class Failed:
    code: str
    message: str


EngineEvent = Queued | Started | Progress | Delta | Done | Failed


MAINTAIN_EVERY = 5.0  # seconds between idle-demotion checks while nothing runs
WARM_UP_TOKENS = 16  # a short turn's prefill, then one decode step
MIN_CHUNK = 8  # prompt tokens: smaller prefill chunks would mostly re-read the weights
PROGRESS_EVERY = 0.25  # seconds between Progress events of one prefill: a few a second is enough to watch


class PromptTooLong(Exception):
    pass


@dataclass
class _Waiting:
    job: GenerationJob
    told: int  # the position the job was last told


@dataclass
class _Active:
    job: GenerationJob
    detokenizer: Any
    prompt: list[int]
    cached_len: int
    restored_from: str
    restore_ms: float
    inserted: float
    sampler: Any
    prefill: Prefill | None  # while the prompt is being fed; then the session decodes in the batch
    uid: int | None = None  # its sequence in the BatchGenerator once decoding
    first: int | None = None  # the token sampled from the prompt's last chunk, fed by the first decode step
    progress_at: float | None = None  # when the last Progress event was sent
    generated: int = 0
    t_first: float | None = None
    t_last: float | None = None


class Engine:
    """Owns the model; serves GenerationJobs through one BatchGenerator."""

    def __init__(self, config: Config, model_dir: Path | None = None):
        """`model_dir`: the model already prepared (daemon/models.py) by `kvd serve` before it
        listened; None prepares it on the engine thread."""
        self.config = config
        self.model_dir = model_dir
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self._inbox: queue.SimpleQueue[GenerationJob | _Cancel | _Forget | _Stop | _Status] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvd-engine", daemon=True)
        self._active: dict[str, _Active] = {}  # by session id
        self._by_uid: dict[int, str] = {}  # sessions decoding in the batch
        self._prefilling: list[str] = []  # sessions whose prompt is being fed, first come first
        self._waiting: list[_Waiting] = []  # jobs past max_generations, in arrival order
        self._prefill_tps: float | None = None  # the last prefill chunk's tokens per second
        self.max_context: int | None = None  # the model's context length, once loaded (if it says)
        self.caches: SessionCaches | None = None  # every idle session's cache, by tier
        self.stats: dict[str, Any] = {}  # replaced wholesale; safe to read from other threads
        self.warm_up_ms: float | None = None  # the first forward, run before `ready`
        self._prefetch: list[str] = []  # sessions to page in from disk while idle, next first

    # --- called from other threads ---

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: GenerationJob) -> None:
        self._inbox.put(job)

    def cancel(self, session_id: str) -> None:
        self._inbox.put(_Cancel(session_id))

    def forget(self, session_id: str) -> None:
        """Drop a deleted session's cache from every tier (it must not be generating)."""
        self._inbox.put(_Forget(session_id))

    def query_status(self, reply: Callable[[dict[str, Any]], None]) -> None:
        """Ask for fresh statistics: answered between steps, after any finished turn is kept."""
        self._inbox.put(_Status(reply))

    def stop(self, timeout: float | None = None) -> None:
        """Cancel whatever runs (each job gets its Done) and end the thread."""
        self._inbox.put(_Stop())
        self._thread.join(timeout)

    # --- the engine thread ---

    def _load(self) -> None:
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_lm.utils import load

        from .models import prepare_model

        name = self.config.model
        path = str(self.model_dir or prepare_model(name, self.config.models_dir))
        t0 = time.perf_counter()
        model, tokenizer, model_config = load(path, return_config=True)  # type: ignore[misc]
        if not mx.metal.is_available():
            # On the CPU backend float32 matmuls are ~20x faster than bf16/fp16.
            model.set_dtype(mx.float32)
        from cachestore.manager import Budgets, SessionCaches
        from cachestore.quantized import make_cache
        from cachestore.segments import fingerprint
        from cachestore.snapshot import layout as cache_layout

        kv_bits = self.config.kv_bits or None
        layout = cache_layout(make_cache(model, kv_bits))
        params: Any = tree_flatten(model.parameters())
        dtype = str(params[0][1].dtype)
        c = self.config
        self.caches = SessionCaches(
            c.cache_dir,
            fingerprint(model_id=name, config=model_config, dtype=dtype, kv_bits=kv_bits, layout=layout),
            Budgets(resident_bytes=c.resident_bytes, warm_bytes=c.warm_bytes,
                    disk_bytes=c.disk_bytes, resident_idle=c.resident_idle,
                    warm_idle=c.warm_idle, max_segments=c.max_segments,
                    resident_sessions=c.max_resident_sessions, warm_bits=c.warm_bits),
        )
        self.model, self.tokenizer = model, tokenizer
        args = getattr(model, "args", None)
        self.max_context = int(getattr(args, "max_position_embeddings", 0) or 0) or None
        log.info("loaded %s (%s) in %.1f s", name, getattr(args, "model_type", "?"),
                 time.perf_counter() - t0)
        self._new_generator()
        self._warm_up()

    def _warm_up(self) -> None:
        """Run one short prefill and one decode step before `ready`, on a throwaway cache.

        MLX's first forward after a load pays for allocating its buffers and
        waking the BLAS threads: measured on SmolLM2-135M, a 13-token turn
        over a 2k context took 687 ms as the first forward and 480 ms after.
        That cost belongs to start-up, not to the first user's turn.
        """
        import mlx.core as mx

        from cachestore.quantized import make_cache

        t0 = time.perf_counter()
        cache = make_cache(self.model, self.config.kv_bits or None)
        ids = (self.tokenizer.encode("Hello, who are you?") * 4)[:WARM_UP_TOKENS] or [0] * WARM_UP_TOKENS
        logits = self.model(mx.array([ids]), cache=cache)
        token = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(self.model(token[:, None], cache=cache))
        self.warm_up_ms = (time.perf_counter() - t0) * 1000
        log.info("warmed up in %.0f ms (a %d-token prefill and a decode step)", self.warm_up_ms, len(ids))

    def _new_generator(self) -> None:
        from mlx_lm.generate import BatchGenerator

        self.generator = BatchGenerator(
            self.model,
            stop_tokens=[[t] for t in sorted(self.tokenizer.eos_token_ids)],
            prefill_step_size=self.config.prefill_step_size,
            completion_batch_size=self.config.max_generations,
        )

    def _run(self) -> None:
        try:
            self._load()
        except BaseException as e:  # reported to every client; `kvd serve` then stops (startup.py)
            log.debug("loading model %s failed", self.config.model, exc_info=True)
            self.load_error = e
        if self.caches is not None and self.config.prefetch:
            self._prefetch = self.caches.prefetch_plan()
        self._publish_stats()
        self.ready.set()
        while True:
            try:
                if self._active or self._prefetch:
                    cmd = self._inbox.get(block=False)
                else:
                    cmd = self._inbox.get(timeout=MAINTAIN_EVERY)
            except queue.Empty:
                cmd = None
                if not self._active and self.caches is not None:
                    if self._prefetch:
                        self._prefetch_one()
                    else:
                        self.caches.maintain()
                    self._publish_stats()
            if isinstance(cmd, _Stop):
                for sid in [w.job.session_id for w in self._waiting] + list(self._active):
                    self._cancel(sid)
                if self.caches is not None:
                    self.caches.page_out_all()
                    self.caches.close()
                return
            if isinstance(cmd, GenerationJob):
                self._start(cmd)
            elif isinstance(cmd, _Cancel):
                self._cancel(cmd.session_id)
            elif isinstance(cmd, _Forget):
                if self.caches is not None and cmd.session_id not in self._active:
                    self.caches.forget(cmd.session_id)
                    self._publish_stats()
            elif isinstance(cmd, _Status):
                self._publish_stats()
                cmd.reply(self.stats)
            if self._waiting:
                self._admit_waiting()
            if self._active and self._inbox.empty():
                self._step()

    def _prefetch_one(self) -> None:
        """Page the next planned session into warm: only while nothing else runs.

        The lowest priority there is: a decode step or a queued job always
        goes first, and a job that arrives meanwhile waits for at most one
        session's page-in (~0.1 s for a 2k-token SmolLM2 cache). A session
        asked for before its turn in the plan is restored the usual way.
        """
        assert self.caches is not None
        key = self._prefetch.pop(0)
        try:
            if self.caches.prefetch(key):
                log.debug("prefetched the cache of %s into warm", key)
        except Exception:
            log.exception("prefetching the cache of %s failed; it stays on disk", key)
        if not self._prefetch:
            s = self.caches.statistics()["warm"]
            log.info("prefetched %d session(s) into warm (%d bytes)", s["prefetched"], s["prefetched_bytes"])

    def _start(self, job: GenerationJob) -> None:
        if self.load_error is not None:
            job.emit(Failed(p.INTERNAL, f"the model failed to load: {self.load_error}"))
            return
        if job.session_id in self._active or any(w.job.session_id == job.session_id for w in self._waiting):
            job.emit(Failed(p.BUSY, "this session is already generating"))
            return
        if len(self._active) >= self.config.max_generations:
            self._waiting.append(_Waiting(job, told=len(self._waiting) + 1))
            job.emit(Queued(len(self._waiting)))
            return
        self._admit(job)

    def _admit_waiting(self) -> None:
        """Start waiting jobs while there is room; tell the rest their new places."""
        while self._waiting and len(self._active) < self.config.max_generations:
            self._admit(self._waiting.pop(0).job)
        for position, w in enumerate(self._waiting, start=1):
            if w.told != position:
                w.told = position
                w.job.emit(Queued(position))

    def _admit(self, job: GenerationJob) -> None:
        try:
            self._insert(job)
        except PromptTooLong as e:
            job.emit(Failed(p.TOO_LARGE, str(e)))
        except Exception as e:
            log.exception("starting generation for %s failed", job.session_id)
            job.emit(Failed(p.INTERNAL, f"generation failed to start: {e}"))

    def _insert(self, job: GenerationJob) -> None:
        from mlx_lm.sample_utils import make_sampler

        from cachestore.quantized import make_cache

        from .prefill import Prefill

        tokens, retokenized = job.prompt.ids(self.tokenizer)
        if self.max_context and len(tokens) + job.max_tokens > self.max_context:
            raise PromptTooLong(
                f"the conversation ({len(tokens)} tokens) plus max_tokens ({job.max_tokens}) "
                f"exceeds the model's context of {self.max_context} tokens; "
                + _fit_advice(len(tokens), self.max_context)
            )
        assert self.caches is not None
        if job.source is not None:
            out = self.caches.copy_prefix(job.source, tokens)
        else:
            out = self.caches.checkout(job.session_id, tokens)
        if job.seed is not None:
            import mlx.core as mx

            mx.random.seed(job.seed)
        cache, cached = out.cache, out.tokens
        if cache is None or cached == 0:
            cache, cached = make_cache(self.model, self.config.kv_bits or None), 0
        self._active[job.session_id] = _Active(
            job=job, detokenizer=self.tokenizer.detokenizer, prompt=tokens, cached_len=cached,
            restored_from=out.source, restore_ms=out.restore_ms, inserted=time.perf_counter(),
            sampler=make_sampler(job.temperature, top_p=job.top_p if job.top_p < 1 else 0.0),
            prefill=Prefill(self.model, cache, tokens, cached, step=self.config.prefill_step_size),
        )
        self._prefilling.append(job.session_id)
        job.emit(Started(prompt_tokens=len(tokens), cached_tokens=cached, retokenized=retokenized))

    def _step(self) -> None:
        """One decode step for every session in the batch, then one prefill chunk."""
        if self._by_uid:
            self._decode()
        if self._prefilling:
            self._prefill(self._prefilling[0])

    def _prefill(self, session_id: str) -> None:
        import mlx.core as mx

        from .prefill import first_token

        act = self._active[session_id]
        assert act.prefill is not None
        n, before = self._chunk_size(), act.prefill.fed
        try:
            t0 = time.perf_counter()
            with mx.stream(self.generator.stream):
                logprobs = act.prefill.advance(n)
                token = first_token(logprobs, act.sampler) if logprobs is not None else None
            now = time.perf_counter()
            self._prefill_tps = (act.prefill.fed - before) / max(now - t0, 1e-6)
            if token is None:
                if act.progress_at is None or now - act.progress_at >= PROGRESS_EVERY:
                    act.progress_at = now
                    act.job.emit(Progress(fed=act.prefill.fed, total=len(act.prefill.tokens)))
                return
        except Exception as e:
            log.exception("prefill for %s failed", session_id)
            act.job.emit(Failed(p.INTERNAL, f"generation failed: {e}"))
            self._forget(session_id)
            return
        self._prefilling.remove(session_id)
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
        from cachestore.quantized import as_batchable

        # The first token is the sequence's one-token prompt: BatchGenerator feeds it and
        # samples on; its max_tokens counts from the second token.
        (uid,) = self.generator.insert(
            [[token]], max_tokens=[job.max_tokens - 1], caches=[as_batchable(prefill.cache)],
            all_tokens=[prefill.tokens], samplers=[act.sampler],
        )
        act.uid = uid
        self._by_uid[uid] = session_id

    def _chunk_size(self) -> int:
        """Prompt tokens to feed this step.

        Alone, `prefill_step_size`. Beside sessions that are decoding, as many
        as take about `prefill_slice` seconds at the last chunk's rate, so
        their streams keep moving through a long prefill.
        """
        step = self.config.prefill_step_size
        if not self._by_uid:
            return step
        if self._prefill_tps is None:
            return min(step, MIN_CHUNK)
        return max(min(step, MIN_CHUNK), min(step, int(self._prefill_tps * self.config.prefill_slice)))

    def _decode(self) -> None:
        try:
            _, responses = self.generator.next()
        except Exception as e:
            # The batch is in an unknown state: fail everyone in it, start afresh.
            log.exception("generation step failed")
            for sid in list(self._by_uid.values()):
                self._active[sid].job.emit(Failed(p.INTERNAL, f"generation failed: {e}"))
                self._forget(sid)
            self._new_generator()
            return
        now = time.perf_counter()
        for r in responses:
            owner = self._by_uid.get(r.uid)
            if owner is None:
                continue
            act = self._active[owner]
            self._took(act, r.token, now, shown=r.finish_reason != "stop")
            if r.finish_reason is not None:
                self._finish(act, r.finish_reason, r.prompt_cache, list(r.all_tokens))

    def _took(self, act: _Active, token: int, now: float, *, shown: bool = True) -> None:
        act.generated += 1
        act.t_first = act.t_first or now
        act.t_last = now
        if shown and token not in self.tokenizer.eos_token_ids:  # a stop token is never shown
            act.detokenizer.add_token(token)
            if text := act.detokenizer.last_segment:
                act.job.emit(Delta(text))

    def _cancel(self, session_id: str) -> None:
        waiting = next((w for w in self._waiting if w.job.session_id == session_id), None)
        if waiting is not None:
            self._waiting.remove(waiting)
            job = waiting.job
            job.emit(Done("cancelled", self._usage(_Active(
                job=job, detokenizer=None, prompt=[], cached_len=0, restored_from=p.NO_CACHE,
                restore_ms=0.0, inserted=job.arrived, sampler=None, prefill=None)), None))
            return
        act = self._active.get(session_id)
        if act is None:
            return
        if act.prefill is not None:
            # Keep what was prefilled for next time; the fed ids stay as they were.
            self._prefilling.remove(session_id)
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

    def _finish(self, act: _Active, reason: str, cache: list[Any] | None, tokens: list[int],
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
        act.job.emit(Done(reason, self._usage(act), history if tokens and changed else None))
        # Behind the turn: the client has its answer; now keep the cache and page out its new tokens.
        if cache is not None and tokens and self.caches is not None:
            try:
                self.caches.checkin(sid, cache, tokens)
            except Exception:
                log.exception("keeping the cache of %s failed; it will prefill next time", sid)
        self._publish_stats()

    def _forget(self, session_id: str) -> None:
        act = self._active.pop(session_id, None)
        if act is not None and act.uid is not None:
            self._by_uid.pop(act.uid, None)
        if session_id in self._prefilling:
            self._prefilling.remove(session_id)

    def _usage(self, act: _Active) -> dict[str, Any]:
        ttft = (act.t_first - act.job.arrived) * 1000 if act.t_first else None
        tps = None
        if act.generated > 1 and act.t_first and act.t_last and act.t_last > act.t_first:
            tps = (act.generated - 1) / (act.t_last - act.t_first)
        prefill_ms = (act.t_first - act.inserted) * 1000 if act.t_first else None
        return {
            "prompt_tokens": len(act.prompt),
            "cached_tokens": act.cached_len,
            "completion_tokens": act.generated,
            "ttft_ms": round(ttft, 1) if ttft is not None else None,
            "decode_tps": round(tps, 1) if tps is not None else None,
            "restored_from": act.restored_from,
            "restored_tokens": act.cached_len,
            "restore_ms": round(act.restore_ms, 2),
            "prefill_tokens": len(act.prompt) - act.cached_len,
            "prefill_ms": round(prefill_ms, 1) if prefill_ms is not None else None,
            # Tokens fed in an earlier turn that had to be fed again (a new system prompt, an edit
            # before the cache's end, a lost cache): what a status line should own up to.
            "reread_tokens": max(min(act.job.prompt.fed_before, len(act.prompt)) - act.cached_len, 0),
            "context_tokens": len(act.prompt) + act.generated if act.prompt else 0,
            "context_window": self.max_context,
        }

    def _publish_stats(self) -> None:
        caches = self.caches.statistics() if self.caches is not None else {}
        where = self.caches.locations() if self.caches is not None else {}
        self.stats = {"generating": len(self._active), "waiting": len(self._waiting),
                      "tiers": caches, "locations": where, "warm_up_ms": self.warm_up_ms}


MIN_ANSWER = 16  # tokens: below this, a lower max_tokens is not worth suggesting


def _fit_advice(prompt: int, context: int) -> str:
    """What to do about a conversation that no longer fits, in the error a client shows."""
    room = context - prompt
    new = "start a new session carrying less of the history (kvchat: /compact)"
    if room >= MIN_ANSWER:
        return f"lower max_tokens to {room} or less, or {new}"
    return new
