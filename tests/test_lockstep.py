"""The lockstep's messages (daemon/engine/lockstep.py): what rank 0 sends is what a follower applies."""

from __future__ import annotations

from daemon.engine.jobs import Cancel, Forget, Stop, TurnJob
from daemon.engine.lockstep import HEADER, Kind, decode_job, encode


def _nowhere(event: object) -> None:
    pass


def test_a_job_arrives_whole() -> None:
    job = TurnJob(session_id="séance-7", tokens=[0, 1, 2**31 - 1, 151_000], max_tokens=4096, temperature=0.7,
                  top_p=0.95, emit=_nowhere, seed=2**64 - 1, retokenized=True, fed_before=300, history=False,
                  grammar='{"type": "object", "x": "ü"}')
    m = encode(job)
    assert m.kind == Kind.JOB and 2 + len(m.fields) <= HEADER
    assert all(-(2**31) <= v < 2**31 for v in [*m.fields, *m.payload])  # every value fits the int32 buffer
    got = decode_job(m, _nowhere)
    assert isinstance(got, TurnJob)
    for name in ("session_id", "tokens", "max_tokens", "temperature", "top_p", "seed", "retokenized",
                 "fed_before", "history", "grammar"):
        assert getattr(got, name) == getattr(job, name), name
    assert decode_job(encode(TurnJob("s", [5], 1, 0.0, 1.0, _nowhere, seed=0)), _nowhere).seed == 0  # type: ignore[union-attr]
    plain = decode_job(encode(TurnJob("s", [5], 1, 0.0, 1.0, _nowhere)), _nowhere)
    assert isinstance(plain, TurnJob) and plain.seed is None and plain.grammar is None


def test_commands_and_ticks() -> None:
    assert decode_job(encode(Cancel("abc")), _nowhere) == Cancel("abc")
    assert decode_job(encode(Forget("abc")), _nowhere) == Forget("abc")
    assert encode(Stop()).kind == Kind.STOP
    tick = encode(Kind.STEP)
    assert tick.kind == Kind.STEP and not tick.fields and not tick.payload  # a step is one 64-byte header
    assert HEADER * 4 == 64
