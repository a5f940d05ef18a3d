"""Rank 0 decides, every rank applies: the engine's decisions sent to the follower ranks.

With the model sharded across ranks (`model.shard(group)`), every forward is
a collective: every rank must run the same forwards in the same order. Rank
0's engine thread makes every decision (which job starts with which token
ids, cancels, forgets, each engine step, each prefill chunk's size, idle
upkeep, stop) and sends it here before acting on it; the followers
(follower.py) receive it and act the same.

The channel is MLX's own (as mlx_lm.server's): an int32 array summed across
ranks with `mx.distributed.all_sum`, the followers adding zeros. Each
message is a HEADER of 16 ints (64 bytes: a step tick is one header); a
variable payload (a job's token ids and session id) follows in chunks of at
most CHUNK ints whose sizes the header gave. Measured by bench/distributed.py:
a decode step costs one 64-byte tick here, beside the model's own all_sums
inside the forward (docs/distributed.md).

A collective that fails (a rank died: "[ring] connection to a peer was
lost") or that takes longer than KVD_RANK_TIMEOUT seconds (a host lost
without a word) ends this rank with one line naming the rank it lost; the
transcript is rank 0's, the caches are on disk, and a restart of the group
resumes every session.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any, NoReturn, cast

from common.tiers import NO_CACHE
from protocol.shapes import Sampling

from .doorbell import Doorbell, rank0_address
from .jobs import Cancel, Forget, Stop
from .running import Answer

log = logging.getLogger("kvd.lockstep")

HEADER = 16  # ints in every message: 64 bytes
CHUNK = 1 << 14  # ints in each payload chunk after the header
TIMEOUT = 30.0  # seconds a collective may take before the peer counts as lost (env KVD_RANK_TIMEOUT)
POLL = 1.0  # seconds between the watchdog's looks


class Op(IntEnum):
    """What a message tells every rank to do (the first int of its header)."""

    STEP = 1  # one engine step (Engine.advance)
    IDLE = 2  # idle upkeep: tier demotion or a prefetch (Engine.idle)
    JOB = 3  # an Answer: fields, then its token ids and session id as payload
    CANCEL = 4
    FORGET = 5
    STOP = 6
    VALUE = 7  # one int rank 0 chose (a prefill chunk's size, the sampler seed)
    SLEEP = 8  # rank 0 is idle: wait on the doorbell, not in all_sum (doorbell.py)


@dataclass
class LockstepMessage:
    op: Op
    fields: list[int]
    payload: list[int]


_ENDING = threading.Lock()  # held by the one thread that ends this rank (Lockstep.fatal)


def _f64(x: float) -> tuple[int, int]:
    lo, hi = struct.unpack("<ii", struct.pack("<d", x))
    return lo, hi


def _from_f64(lo: int, hi: int) -> float:
    x: float = struct.unpack("<d", struct.pack("<ii", lo, hi))[0]
    return x


def _i32(u: int) -> int:
    """An unsigned 32-bit value as the int32 that holds its bits."""
    return u - (1 << 32) if u >= 1 << 31 else u


def encode(cmd: Answer | Cancel | Forget | Stop | Op) -> LockstepMessage:
    """A command as rank 0 sends it (Op.STEP and Op.IDLE stand for themselves)."""
    if isinstance(cmd, Op):
        return LockstepMessage(cmd, [], [])
    if isinstance(cmd, Stop):
        return LockstepMessage(Op.STOP, [], [])
    sid = list(cmd.session_id.encode())
    if isinstance(cmd, (Cancel, Forget)):
        return LockstepMessage(Op.CANCEL if isinstance(cmd, Cancel) else Op.FORGET, [len(sid)], sid)
    seed = cmd.seed if cmd.seed is not None else 0
    grammar = list(cmd.grammar.encode()) if cmd.grammar is not None else []
    fields = [len(sid), len(cmd.tokens), cmd.max_tokens, *_f64(cmd.temperature), *_f64(cmd.top_p),
              int(cmd.seed is not None), _i32(seed & 0xFFFFFFFF), _i32(seed >> 32), int(cmd.retokenized),
              cmd.fed_before, int(cmd.history), int(cmd.grammar is not None)]
    return LockstepMessage(Op.JOB, fields, [*cmd.tokens, *grammar, *sid])


def decode_job(m: LockstepMessage, emit: Any) -> Answer | Cancel | Forget:
    """A follower's copy of rank 0's command; its events go to `emit` (nowhere)."""
    n_sid = m.fields[0]
    sid = bytes(m.payload[len(m.payload) - n_sid:]).decode()
    if m.op == Op.CANCEL:
        return Cancel(sid)
    if m.op == Op.FORGET:
        return Forget(sid)
    _, n, max_tokens, t0, t1, p0, p1, has_seed, s0, s1, retok, fed_before, history, has_grammar = m.fields[:14]
    grammar = bytes(m.payload[n:len(m.payload) - n_sid]).decode() if has_grammar else None
    return Answer(session_id=sid, tokens=m.payload[:n], emit=emit,
                   sampling=Sampling.of(max_tokens, _from_f64(t0, t1), _from_f64(p0, p1)),
                   seed=(s0 & 0xFFFFFFFF) | ((s1 & 0xFFFFFFFF) << 32) if has_seed else None,
                   retokenized=bool(retok), fed_before=fed_before, history=bool(history), grammar=grammar)


class Lockstep:
    """One rank's end of the control channel; every method runs on the engine thread."""

    def __init__(self, group: Any, *, timeout: float = TIMEOUT):
        self.group = group
        self.rank: int = group.rank()
        self.size: int = group.size()
        self.timeout = timeout
        # Every collective of a rank runs in one order on every rank: the model's all_sums run on the
        # generator's stream (evaluated asynchronously), so this channel's run there too (Engine.load).
        self.stream: Any = None
        self.bytes = 0  # bytes this rank put into control collectives (bench/distributed.py reads it)
        self.messages = 0
        self._bell: Doorbell | None = None
        self._asleep = False  # rank 0 said SLEEP and has not rung since
        self._since: float | None = None  # when the watched wait began; None: not watched
        self._watchdog = threading.Thread(target=self._watch, name="kvd-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def heartbeat(self) -> float:
        """The longest rank 0 may stay silent while idle: well inside the followers' watchdog."""
        return self.timeout / 3

    def peers(self) -> str:
        """The rank(s) this rank would lose: named when there is only one."""
        others = [r for r in range(self.size) if r != self.rank]
        return f"rank {others[0]}" if len(others) == 1 else "one of ranks " + ", ".join(map(str, others))

    def open_doorbell(self) -> None:
        """Every rank, at the same point of the start: the idle wake-up channel (doorbell.py), if any."""
        address = rank0_address()
        if self.share(int(address is not None)):
            assert address is not None
            try:
                self._bell = Doorbell(self.rank, self.size, address, self.share)
            except OSError as e:
                self.lost(e)

    # --- rank 0 ---

    def sleep(self) -> None:
        """Before rank 0 blocks on its inbox: the followers wait on the doorbell until the next message."""
        if self._bell is not None and not self._asleep:
            self.send(Op.SLEEP)
            self._asleep = True

    def send(self, cmd: Answer | Cancel | Forget | Stop | Op) -> None:
        assert self.rank == 0
        m = encode(cmd)
        self._sum([m.op, len(m.payload), *m.fields], HEADER)
        for at in range(0, len(m.payload), CHUNK):
            self._sum(m.payload[at:at + CHUNK], min(CHUNK, len(m.payload) - at))

    # --- followers ---

    def receive(self) -> LockstepMessage:
        assert self.rank > 0
        head = self._sum([], HEADER)
        op, length, fields = self._op(head[0]), head[1], head[2:]
        if op == Op.SLEEP:
            assert self._bell is not None
            if not self._bell.wait():
                self.lost(ConnectionError("rank 0 closed the doorbell"))
            return self.receive()
        payload: list[int] = []
        while len(payload) < length:
            payload += self._sum([], min(CHUNK, length - len(payload)))
        return LockstepMessage(op, fields, payload)

    # --- every rank ---

    def share(self, value: int) -> int:
        """Rank 0's `value` on every rank (the followers' own is ignored)."""
        if self.rank == 0:
            self._sum([Op.VALUE, 0, value], HEADER)
            return value
        head = self._sum([], HEADER)
        if head[0] != Op.VALUE:
            self.fatal(f"rank {self.rank} is out of step with rank 0 (got {self._op(head[0]).name}, "
                       "wanted a value)")
        return head[2]

    def _op(self, value: int) -> Op:
        try:
            return Op(value)
        except ValueError:  # a collective of the model's where a message should be: never expected
            self.fatal(f"rank {self.rank} is out of step with rank 0 (got {value} where a message begins)")

    def minimum(self, value: int) -> int:
        """The smallest of every rank's `value` (each rank fills its own slot of one all_sum)."""
        slots = [0] * self.size
        slots[self.rank] = value
        return min(self._sum(slots, self.size))

    def common_prefix(self, out: Any) -> Any:
        """A checkout cut to the prefix every rank holds (cachestore's Checkout), or to none.

        Each rank restored what its own tiers hold; they agree on the shortest,
        rewind to it where they hold more, and if any rank cannot rewind
        (a wrapped sliding window) every rank starts from nothing: the rest is
        prefilled, never guessed.
        """
        from cachestore import rewind

        held = out.tokens if out.cache is not None else 0
        n = self.minimum(held)
        able = n > 0 and (n == held or rewind(out.cache, held - n))
        if not self.minimum(int(able)):
            if held:
                log.info("rank %d held %d token(s); the ranks share none: prefilling", self.rank, held)
            return replace(out, cache=None, tokens=0, restored_from=NO_CACHE, shared_tokens=0, checkpoint=False)
        if n < held:
            log.info("rank %d held %d token(s), every rank %d: restoring %d", self.rank, held, n, n)
        return replace(out, tokens=n, shared_tokens=min(out.shared_tokens, n))

    def _sum(self, values: Sequence[int], size: int) -> list[int]:
        import mlx.core as mx

        buf = [0] * size
        buf[:len(values)] = values
        if self._asleep:
            assert self._bell is not None
            self._asleep = False
            try:
                self._bell.ring()
            except OSError as e:
                self.lost(e)
        try:
            with mx.stream(self.stream if self.stream is not None else mx.default_stream(mx.default_device())):
                out = mx.distributed.all_sum(mx.array(buf, dtype=mx.int32), group=self.group)
                mx.eval(out)
        except RuntimeError as e:
            self.lost(e)
        if self._since is not None:
            self._since = time.monotonic()  # the other ranks answered: the watched wait starts again
        self.bytes += 4 * size
        self.messages += 1
        return cast(list[int], out.tolist())

    # --- faults ---

    @contextmanager
    def watched(self) -> Iterator[None]:
        """Count the time inside as waiting on the other ranks (rank 0's idle waits are not); an
        error inside, which the engine did not handle, ends the rank like a lost one."""
        self._since = time.monotonic()
        try:
            yield
        except Exception as e:
            self.lost(e)
        finally:
            self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(POLL)
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout:
                self.fatal(f"lost {self.peers()} (no word for {self.timeout:g} s: KVD_RANK_TIMEOUT); "
                           "stopping; restart the group to resume every session from disk")

    def lost(self, e: BaseException) -> NoReturn:
        """A failed step on a sharded model: the ranks are no longer in step, so this one ends.

        A failed collective or socket names the rank it lost; any other error (the traceback is
        in the log with -v) says the ranks can no longer be known to agree.
        """
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if isinstance(e, OSError) or first.startswith("["):  # "[ring] connection to a peer was lost"
            self.fatal(f"lost {self.peers()} ({first}); stopping; restart the group to resume every "
                       "session from disk")
        log.debug("an engine step failed on rank %d", self.rank, exc_info=e)
        self.fatal(f"an engine step failed here ({type(e).__name__}: {first}), so the ranks can no longer "
                   "be known to agree; stopping; restart the group to resume every session from disk")

    def fatal(self, why: str) -> NoReturn:
        """One line, then the process ends at once, as after kill -9: what is durable stays durable.

        The engine thread (a failed collective) and the watchdog (a slow one) can both get here
        at once; the first says why, the other waits for the end.
        """
        if not _ENDING.acquire(blocking=False):
            threading.Event().wait()
        log.error("error: rank %d: %s", self.rank, why)
        for h in logging.getLogger().handlers:
            h.flush()
        os._exit(1)


def from_env(timeout: float = TIMEOUT) -> Lockstep | None:
    """This process's end of the group when it runs under mlx.launch with more than one rank, else None."""
    if "MLX_RANK" not in os.environ:  # mlx.launch sets it for every rank
        return None
    import mlx.core as mx

    group = mx.distributed.init(strict=True)
    if group.size() < 2:
        return None
    return Lockstep(group, timeout=timeout)
