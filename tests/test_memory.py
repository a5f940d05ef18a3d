"""One memory decision-maker per daemon (daemon/engine/memory.py): loads, unloads and turns at once.

A real daemon on a real port (this process) serving builtin:tiny and builtin:tiny-swa over the
websocket protocol, under a `[models] memory` limit that fits one model with its full cache budgets,
and an unload made slow on purpose (its engine's close waits for the test's word). Sampled all
along: the bytes counted (every model's weights, loaded, loading or still unloading, and every
model's caches in memory) never pass the limit; a request for a model that is unloading waits for
its engine to stop, then loads it again; the other model answers meanwhile; and the caches' budgets
shrink before a model loads and grow back once it has unloaded.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from conftest import EVENT_TIMEOUT, Client, RunningDaemon, client, running_daemon
from daemon.engine.memory import Memory
from daemon.engine.thread import Engine
from daemon.models.footprint import weights_bytes
from daemon.models.sources import prepare_model

pytestmark = pytest.mark.anyio

TINY, SWA = "builtin:tiny", "builtin:tiny-swa"
KiB, MiB = 1 << 10, 1 << 20
RESIDENT, WARM = 3 * MiB, 2 * MiB  # configured: each model's turns here hold well under a MiB
_ids = itertools.count()


def weights(tmp_path: Path) -> dict[str, int]:
    return {m: weights_bytes(prepare_model(m, tmp_path / "sizes"), "float32") for m in (TINY, SWA)}


class Gate:
    """An engine's close made slow: it says it began (`reached`), then waits for the test (`open`)."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.open = threading.Event()

    def hold(self, engine: Engine) -> Engine:
        close = engine.close

        def slow_close() -> None:  # on the engine thread, as its stop runs
            self.reached.set()
            self.open.wait(EVENT_TIMEOUT)
            close()

        engine.close = slow_close  # type: ignore[method-assign]
        return engine


@contextmanager
def sampled(memory: Memory, limit: int) -> Iterator[list[dict[str, int]]]:
    """The bytes counted and the caches' budgets, sampled every millisecond or so from another thread;
    fails the test if the count ever passed `limit`."""
    samples: list[dict[str, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.001):
            pool = memory.pool()
            samples.append({"counted": memory.counted(), "weights": memory.weights(),
                            **(pool.budgets if pool is not None else {})})

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()
    over = [s for s in samples if s["counted"] > limit]
    assert samples and not over, over[:3]


async def turn(c: Client, session: str, text: str, **fields: Any) -> dict[str, Any]:
    """One chat.send: its closing event (chat.done, or an error)."""
    rid = f"t{next(_ids)}"
    await c.send({"id": rid, "type": "chat.send", "session": session, "text": text, "temperature": 0.0,
                  "max_tokens": 8, **fields})
    while True:
        event = await c.recv()
        if event.get("id") == rid and event["type"] in ("chat.done", "error"):
            return event


@asynccontextmanager
async def daemon(tmp_path: Path, limit: int, **budgets: Any) -> AsyncIterator[tuple[RunningDaemon, Memory]]:
    async with running_daemon(tmp_path / "d", model=TINY, models_memory=limit, **budgets) as d, client(d) as c:
        await turn(c, (await c.request("session.create"))["session"]["id"], "warm")  # the default is ready
        yield d, d.daemon.engines.memory


async def test_budgets_shrink_before_a_load_grow_back_after_a_slow_unload_and_nothing_passes_the_limit(
        tmp_path: Path) -> None:
    size = weights(tmp_path)
    limit = size[TINY] + size[SWA] + 3 * MiB  # one model beside its full budgets; two beside squeezed ones
    gate = Gate()
    async with daemon(tmp_path, limit, resident_bytes=RESIDENT, warm_bytes=WARM) as (d, memory), \
            client(d) as a, client(d) as b:
        full = {"resident": RESIDENT, "warm": WARM}
        assert memory.statistics()["budgets"] == full and memory.weights() == size[TINY]
        make = memory.make
        memory.make = lambda config, path: gate.hold(make(config, path))  # tiny-swa's close will wait
        ours = {m: [(await a.request("session.create", model=m))["session"]["id"] for _ in range(2)]
                for m in (TINY, SWA)}
        with sampled(memory, limit) as samples, anyio.fail_after(4 * EVENT_TIMEOUT):
            # tiny-swa loads while tiny answers: its footprint counts, and the budgets shrink, before the load.
            async with anyio.create_task_group() as tg:
                tg.start_soon(turn, b, ours[SWA][0], "load tiny-swa")
                for sid in ours[TINY]:
                    assert (await turn(a, sid, "tiny answers meanwhile"))["type"] == "chat.done"
            squeezed = memory.statistics()["budgets"]
            assert sum(squeezed.values()) <= limit - size[TINY] - size[SWA] < sum(full.values())
            assert memory.weights() == size[TINY] + size[SWA]
            assert (await turn(b, ours[SWA][0], "tiny-swa again"))["type"] == "chat.done"

            unloaded: list[bool] = []
            done: list[dict[str, Any]] = []

            async def unload() -> None:
                unloaded.append(await d.daemon.engines.unload(SWA))

            async def on_swa() -> None:  # asked while tiny-swa unloads: waits, then loads it again
                done.append(await turn(b, ours[SWA][1], "back to tiny-swa"))

            async with anyio.create_task_group() as tg:
                tg.start_soon(unload)
                await anyio.to_thread.run_sync(gate.reached.wait, EVENT_TIMEOUT)  # its engine is stopping
                tg.start_soon(on_swa)
                for n in range(3):  # the other model answers while the unload is under way
                    assert (await turn(a, ours[TINY][n % 2], f"still here {n}"))["type"] == "chat.done"
                # Until its engine has stopped, tiny-swa's weights and caches count, and the budgets stay down.
                assert not unloaded and not done
                assert memory.weights() == size[TINY] + size[SWA]
                assert memory.statistics()["budgets"] == squeezed
                gate.open.set()
            assert unloaded == [True] and done[0]["type"] == "chat.done", done
            assert done[0]["usage"]["restored_from"] == "none"  # a new session; loaded again to answer it
            # With nothing asking for tiny-swa, its unload gives its memory back: the budgets grow back.
            assert await d.daemon.engines.unload(SWA)
            assert memory.weights() == size[TINY] and memory.statistics()["budgets"] == full
        assert max(s["weights"] for s in samples) == size[TINY] + size[SWA]  # never three models' worth
        assert any(s["resident"] < RESIDENT for s in samples)  # and, checked above, back to RESIDENT after


async def test_under_a_limit_for_one_model_a_load_waits_for_the_others_engine_to_stop(tmp_path: Path) -> None:
    size = weights(tmp_path)
    limit = max(size.values()) + 2 * MiB  # one model and its caches; never two
    gate = Gate()
    async with daemon(tmp_path, limit, resident_bytes=1200 * KiB, warm_bytes=800 * KiB) as (d, memory), \
            client(d) as a, client(d) as b:
        first = d.daemon.engines.get(TINY)
        assert first is not None
        gate.hold(first)  # the default's unload, to make room for tiny-swa, is the slow one
        pool = memory.pool()
        ours = {m: (await a.request("session.create", model=m))["session"]["id"] for m in (TINY, SWA)}
        with sampled(memory, limit) as samples, anyio.fail_after(4 * EVENT_TIMEOUT):
            said: list[dict[str, Any]] = []

            async def on_swa() -> None:
                said.append(await turn(b, ours[SWA], "make room for me"))

            async with anyio.create_task_group() as tg:
                tg.start_soon(on_swa)
                await anyio.to_thread.run_sync(gate.reached.wait, EVENT_TIMEOUT)  # tiny is stopping for it
                assert memory.weights() == size[TINY] and d.daemon.engines.get(SWA) is None  # not started yet
                assert [m["state"] for m in d.daemon.engines.loaded()] == ["unloading", "loading"]
                gate.open.set()
            assert said[0]["type"] == "chat.done", said
            swa = d.daemon.engines.get(SWA)
            assert swa is not None and swa.pool is pool  # one pool per daemon, though its maker unloaded
            # Both models asked at once, again and again: each answers, or is refused in one line while the
            # other answers (never loaded beside it).
            for n in range(3):
                async with anyio.create_task_group() as tg:
                    for c, m in ((a, TINY), (b, SWA)):
                        tg.start_soon(_answered_or_refused, c, ours[m], f"turn {n}")
        assert max(s["weights"] for s in samples) <= limit


async def _answered_or_refused(c: Client, session: str, text: str) -> None:
    event = await turn(c, session, text)
    assert event["type"] == "chat.done" or (event["code"] == "too_large" and "\n" not in event["message"]), event
