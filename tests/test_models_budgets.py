"""Two models in one daemon share one resident, one warm and one disk budget (cachestore/pool.py).

A real daemon on a real port (this process) serving builtin:tiny and
builtin:tiny-swa, the websocket protocol. With a resident budget that holds
two idle conversations' caches beside a running turn, and not three, each
model's turn pushes the *other* model's least recently used cache down to
warm (asked on that model's own engine thread), never a more recent one, and
what both models hold never passes the budget, sampled all along. `status`
counts every model's bytes on disk, and says each model's share.
"""

from __future__ import annotations

import asyncio
import io
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from conftest import Client, RunningDaemon, client, running_daemon
from daemon.engine.thread import Engine
from daemon.service.status import human, render_status

pytestmark = pytest.mark.anyio

TINY, SWA = "builtin:tiny", "builtin:tiny-swa"
KiB = 1024
# Measured here (float32 on the CPU), after one turn of a ~230-token conversation: an idle cache takes
# 475 KiB (tiny) or 296 KiB (tiny-swa); a turn may reach one 256-token buffer step, 512 KiB (tiny) or about
# 300 KiB (tiny-swa). So 1120 KiB holds a swa cache beside a tiny turn, and a tiny one beside one (987
# KiB), not both beside a tiny turn (1290 KiB), nor two tiny ones beside a swa turn (1250 KiB).
RESIDENT = 1120 * KiB

def long(topic: str) -> str:
    """A first message of about 220 tokens (one buffer step of the cache with the answer), its own from
    the first word (no two conversations share a prefix)."""
    return f"{topic}: tell me about the weather, the sea and the hills. " * 9


async def turn(c: Client, session: str, text: str) -> dict[str, Any]:
    await c.send({"id": "t", "type": "chat.send", "session": session, "text": text, "temperature": 0.0,
                  "max_tokens": 8})
    while True:
        event = await c.recv()
        if event.get("id") == "t" and event["type"] in ("chat.done", "error"):
            assert event["type"] == "chat.done", event
            return event


async def engine_status(engine: Engine) -> dict[str, Any]:
    """A model's engine statistics, fresh: answered on its thread once its queued writes are done."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[dict[str, Any]] = loop.create_future()

    def reply(s: dict[str, Any]) -> None:  # on the engine thread
        loop.call_soon_threadsafe(got.set_result, s)

    engine.query_status(reply)
    return await asyncio.wait_for(got, 30)


@contextmanager
def sampled(d: RunningDaemon) -> Iterator[dict[str, int]]:
    """The most every model held in each memory tier together, sampled every millisecond or so."""
    peak: dict[str, int] = {}
    over: list[dict[str, Any]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.001):
            pool = d.daemon.turns.engines.pool()
            for tier, t in (pool.statistics() if pool is not None else {}).items():
                peak[tier] = max(peak.get(tier, 0), t["bytes"])
                if t["bytes"] > t["budget"]:
                    over.append({tier: t})

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
    assert over == [], over[:3]


async def where(d: RunningDaemon, model: str) -> dict[str, str]:
    engine = d.daemon.turns.engines.get(model)
    assert engine is not None
    return dict((await engine_status(engine))["locations"])


async def test_each_models_turn_pushes_out_the_other_models_least_recently_used_cache(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model=TINY, resident_bytes=RESIDENT, warm_bytes=64 << 20) as d, \
            client(d) as c:
        ids = {name: (await c.request("session.create", model=model))["session"]["id"]
               for name, model in (("s1", SWA), ("t1", TINY), ("t2", TINY), ("s2", SWA))}
        with sampled(d) as peak:
            await turn(c, ids["s1"], long("Boats"))
            await turn(c, ids["t1"], long("Trains"))
            assert (await where(d, SWA)) == {ids["s1"]: "resident"}
            # t2 does not fit beside s1 and t1: s1 is the oldest, so tiny-swa's engine demotes it.
            await turn(c, ids["t2"], long("Planes"))
            assert (await where(d, SWA)) == {ids["s1"]: "warm"}
            assert (await where(d, TINY)) == {ids["t1"]: "resident", ids["t2"]: "resident"}
            # And the reverse: s2 does not fit beside t1 and t2; t1 is the oldest, so tiny's engine demotes it.
            await turn(c, ids["s2"], long("Bikes"))
            assert (await where(d, TINY)) == {ids["t1"]: "warm", ids["t2"]: "resident"}
            assert (await where(d, SWA)) == {ids["s1"]: "warm", ids["s2"]: "resident"}
            # Each conversation resumes from where its cache is, nothing prefilled again from scratch.
            done = await turn(c, ids["s1"], "Back to the first.")
            assert done["usage"]["restored_from"] == "warm", done["usage"]
        assert 0 < peak["resident"] <= RESIDENT

        status = await c.request("status")
        budgets = status["budgets"]
        assert budgets["resident"]["budget"] == RESIDENT
        assert set(budgets["resident"]["by_model"]) == {TINY, SWA}
        assert sum(budgets["resident"]["by_model"].values()) == budgets["resident"]["bytes"] <= RESIDENT


async def test_status_counts_every_models_bytes_on_disk(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model=TINY) as d, client(d) as c:
        for model in (TINY, SWA):
            session = (await c.request("session.create", model=model))["session"]["id"]
            await turn(c, session, f"Something for {model} to keep on disk.")
            await c.request("status")  # (the default model's writes are done)
        swa = d.daemon.turns.engines.get(SWA)
        assert swa is not None
        await engine_status(swa)  # tiny-swa's writes are on disk
        status = await c.request("status")
        disk = status["tiers"]["disk"]
        assert set(disk["by_model"]) == {TINY, SWA} and all(n > 0 for n in disk["by_model"].values())
        assert disk["bytes"] == sum(disk["by_model"].values()) > disk["model_bytes"] > 0
    console = Console(width=200, file=io.StringIO(), color_system=None)
    render_status(status, console)
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    assert f"the rows above are {TINY}'s but for disk's bytes" in shown
    each = ", ".join(f"{m} {human(disk['by_model'][m])}" for m in (TINY, SWA))
    assert f"  disk: {human(disk['bytes'])} of 20.0 GiB ({each})" in shown
    assert re.search(rf"\n  resident: .* of .* \({re.escape(TINY)} .*, {re.escape(SWA)} .*\)\n", shown), shown


async def test_both_models_answering_at_once_under_a_tight_budget_all_answer_within_it(tmp_path: Path) -> None:
    """Two clients, one per model, each resuming three conversations in turn at the same time, under a
    budget that holds about one conversation's cache beside a turn: the engines ask each other for room
    while both run, every turn answers, and the sampled totals never pass the budgets."""
    async with running_daemon(tmp_path, model=TINY, resident_bytes=RESIDENT, warm_bytes=256 * KiB) as d, \
            client(d) as c1, client(d) as c2:
        ids = {m: [(await c1.request("session.create", model=m))["session"]["id"] for _ in range(3)]
               for m in (TINY, SWA)}
        topics = iter(f"Topic {n}" for n in range(100))

        async def talk(c: Client, model: str) -> list[str]:
            got = []
            for _ in range(2):
                for sid in ids[model]:
                    got.append((await turn(c, sid, long(next(topics))))["usage"]["restored_from"])
            return got

        with sampled(d) as peak:
            done = await asyncio.gather(talk(c1, TINY), talk(c2, SWA))
        assert [len(x) for x in done] == [6, 6]
        assert 0 < peak["resident"] <= RESIDENT and peak["warm"] <= 256 * KiB
