"""The lockstep's messages (daemon/engine/lockstep.py): what rank 0 sends is what a follower applies."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from daemon.engine import lockstep
from daemon.engine.jobs import Cancel, Forget, Stop
from daemon.engine.lockstep import HEADER, Op, decode_job, encode
from daemon.engine.running import Answer
from protocol.shapes import Sampling


def _nowhere(event: object) -> None:
    pass


def test_a_job_arrives_whole() -> None:
    job = Answer(session_id="séance-7", tokens=[0, 1, 2**31 - 1, 151_000], sampling=Sampling.of(4096, 0.7, 0.95),
                  emit=_nowhere, seed=2**64 - 1, retokenized=True, fed_before=300, history=False,
                  grammar='{"type": "object", "x": "ü"}')
    m = encode(job)
    assert m.op == Op.JOB and 2 + len(m.fields) <= HEADER
    assert all(-(2**31) <= v < 2**31 for v in [*m.fields, *m.payload])  # every value fits the int32 buffer
    got = decode_job(m, _nowhere)
    assert isinstance(got, Answer)
    for name in ("session_id", "tokens", "max_tokens", "temperature", "top_p", "seed", "retokenized",
                 "fed_before", "history", "grammar"):
        assert getattr(got, name) == getattr(job, name), name
    assert decode_job(encode(Answer("s", [5], Sampling.of(1, 0.0, 1.0), _nowhere, seed=0)), _nowhere).seed == 0  # type: ignore[union-attr]
    plain = decode_job(encode(Answer("s", [5], Sampling.of(1, 0.0, 1.0), _nowhere)), _nowhere)
    assert isinstance(plain, Answer) and plain.seed is None and plain.grammar is None


def test_commands_and_ticks() -> None:
    assert decode_job(encode(Cancel("abc")), _nowhere) == Cancel("abc")
    assert decode_job(encode(Forget("abc")), _nowhere) == Forget("abc")
    assert encode(Stop()).op == Op.STOP
    tick = encode(Op.STEP)
    assert tick.op == Op.STEP and not tick.fields and not tick.payload  # a step is one 64-byte header
    assert HEADER * 4 == 64


class _Group:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_the_watchdog_ends_a_rank_that_waits_too_long_with_one_line(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(lockstep, "POLL", 0.01)
    monkeypatch.setattr(lockstep, "_ENDING", threading.Lock())  # this process goes on after its "end"
    ended: list[int] = []
    done = threading.Event()
    ls = lockstep.Lockstep(_Group(0, 2), timeout=0.2)

    def exit_(code: int) -> None:  # instead of os._exit, on the watchdog's thread
        ls._since = None  # so it fires once
        ended.append(code)
        done.set()

    monkeypatch.setattr(os, "_exit", exit_)
    idle = time.monotonic()
    assert not done.wait(0.3)  # rank 0 idle (not watched): never
    with ls.watched():
        assert done.wait(10)
    assert ended == [1] and time.monotonic() - idle >= 0.3 + 0.2
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert lines == ["error: rank 0: lost rank 1 (no word for 0.2 s: KVD_RANK_TIMEOUT); stopping; restart "
                     "the group to resume every session from disk"]


def test_a_follower_names_rank_0_and_a_larger_group_names_its_peers() -> None:
    assert lockstep.Lockstep(_Group(1, 2)).peers() == "rank 0"
    assert lockstep.Lockstep(_Group(0, 4)).peers() == "one of ranks 1, 2, 3"


def test_ranks_on_one_host_share_its_cpus_by_the_hostfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from daemon.config import Config
    from daemon.engine.doorbell import rank0_address, ring_hosts
    from daemon.service.blas import usable_cpus
    from daemon.service.ranks import blas_threads, hostfile

    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    monkeypatch.setenv("MLX_RANK", "1")
    assert (ring_hosts(), rank0_address(), blas_threads(Config())) == (None, None, 0)  # 0: the BLAS's own count
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile(tmp_path / "ranks.json", 2, 40000)))
    assert (ring_hosts(), rank0_address()) == (["127.0.0.1", "127.0.0.1"], "127.0.0.1")
    assert blas_threads(Config()) == max(1, usable_cpus() // 2)
    assert blas_threads(Config(blas_threads=3)) == 3  # configured: as configured
    (tmp_path / "other.json").write_text('[["10.0.0.1:5000"], ["10.0.0.2:5000"], ["10.0.0.2:5001"]]')
    monkeypatch.setenv("MLX_HOSTFILE", str(tmp_path / "other.json"))
    assert blas_threads(Config()) == max(1, usable_cpus() // 2)  # rank 1 shares 10.0.0.2 with rank 2
    monkeypatch.setenv("MLX_RANK", "0")
    assert blas_threads(Config()) == usable_cpus()
    (tmp_path / "other.json").write_text("not json")
    assert (ring_hosts(), blas_threads(Config())) == (None, 0)
