"""The daemon's one memory decision-maker: every load, unload and budget change, decided in order.

Ollama's scheduler (server/sched.go) is the model: one place decides, one decision at a time, and the
next load waits until the memory an unloaded runner held is really free. Here that place is `Memory`,
on the event loop, and "one at a time" is a lock every decision holds while it is carried out:

- a **load** prepares the model's files (outside the lock: fetching or converting holds no model in
  memory), then, in order: waits for the default's load at start, unloads idle models least recently
  used first if the weights would not fit (daemon/device.py's `room_to_load`, waiting until each one's
  engine has stopped), shrinks the caches' budgets to what is left beside the weights *with the new
  model's footprint* (read from its files before a weight is loaded) and waits until every model's
  caches are within them, and only then starts the engine; once it is ready its measured weights
  replace the footprint;
- an **unload** (room_to_load's, keep_alive's) marks the model unloading and stops its engine: until the
  engine has stopped, its weights and its caches still count (its store is still in the pool, paging
  them out), and a request for the model waits for the unload to end, then loads it again;
- the **budgets** (the resident and warm tiers every model's caches share, cachestore's `Pool`) follow
  what the weights leave (daemon/device.py's `Policy.cache_budgets`): down before a load, up after an
  unload, never from what MLX says is allocated (which counts the caches themselves).

So the bytes counted — every model's weights, loaded, loading or still unloading, and every model's
caches in memory — stay within `[models] memory` (`Policy.models_memory`), at every moment a test
samples them (tests/test_memory.py). The pool stays a bookkeeper: it says who evicts next within the
budgets it is given, and decides nothing about them. The first engine makes the pool, on its thread,
with the same rule (`Policy.cache_budgets` beside its own weights): nothing else is loaded then.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from common.sizes import human_bytes
from common.tiers import RESIDENT, WARM

from ..config import Config
from ..device import LoadedModel, room_to_load
from .thread import Engine

if TYPE_CHECKING:
    from cachestore import Pool

log = logging.getLogger("kvd.models")

__all__ = ["Memory", "Slot"]

POLL = 0.05  # seconds between looks at what another thread changes (an engine's `ready`, the caches' bytes)
SAY_WAITING = 5.0  # seconds a decision waits for the caches to shrink before the log says why


@dataclass
class Slot:
    """One model the registry holds: preparing, loading (engine None or not ready), loaded, or unloading."""

    name: str
    engine: Engine | None = None
    nbytes: int = 0  # its weights' bytes: its files' footprint before the load, measured after it
    counted: bool = True  # its bytes count (False while its files are prepared, before its load is decided)
    last_used: float = field(default_factory=time.monotonic)
    settled: anyio.Event = field(default_factory=anyio.Event)  # the load ended, loaded or failed
    error: str | None = None
    refused: bool = False  # the error is "no room" (too_large), not "cannot be loaded"
    unloading: bool = False  # its engine is stopping: its bytes count until `gone`
    gone: anyio.Event = field(default_factory=anyio.Event)  # the unload ended: the engine stopped
    keep_alive: float | None = None  # seconds it stays loaded once idle, as a request set it (None: [models]'s)

    @property
    def ready(self) -> bool:
        """Loaded and answering turns (a failed load is never ready)."""
        e = self.engine
        return self.error is None and e is not None and e.ready.is_set() and e.load_error is None

    def weights(self) -> int:
        """The bytes it counts for: its engine's measured weights once loaded, its footprint before."""
        if self.engine is not None and self.engine.weights_bytes is not None:
            return self.engine.weights_bytes
        return self.nbytes


def _prepare(name: str, models_dir: Path) -> tuple[Path, int]:
    """The model's directory (fetched and converted first if needed) and its weights' bytes as the device
    will run them (a worker thread)."""
    from ..device import current
    from ..models.footprint import weights_bytes
    from ..models.sources import prepare_model

    path = prepare_model(name, models_dir)
    return path, weights_bytes(path, current().weights_dtype)


class Memory:
    """Decides every load, unload and budget change of one daemon, in order (the module's docstring)."""

    def __init__(self, config: Config, slots: dict[str, Slot], *, busy: Callable[[str], bool],
                 make: Callable[[Config, Path], Engine], pool: Callable[[], Pool | None]) -> None:
        """`slots`: the registry's, by name (this adds and removes them). `busy(name)`: whether a turn is on
        that model now. `make`: an engine for a config and a prepared model directory. `pool`: the budgets
        the loaded models' caches share (None until the first engine has made them)."""
        self.config = config
        self.slots = slots
        self.busy = busy
        self.make = make
        self.pool = pool
        self._deciding = anyio.Lock()  # one decision at a time, in the order asked (anyio's lock is fair)

    # --- what is counted ---

    def weights(self) -> int:
        """Every model's weights that hold (or are about to hold) memory: loaded, loading, unloading."""
        return sum(s.weights() for s in tuple(self.slots.values()) if s.counted)  # (a sampler's thread too)

    def counted(self) -> int:
        """The bytes counted against the limit: the weights, and every model's caches in memory."""
        pool = self.pool()
        caches = sum(t["bytes"] for t in pool.statistics().values()) if pool is not None else 0
        return self.weights() + caches

    def limit(self) -> int | None:
        """What the weights and the caches may take together (daemon/device.py); None: no limit known."""
        from ..device import current

        return current().models_memory(self.config.models_memory)

    def statistics(self) -> dict[str, Any]:
        """`status`'s word on memory: the limit, the weights counted, the caches' bytes and budgets (none
        before the first engine has loaded: the device is described on its thread, never on the loop)."""
        pool = self.pool()
        if pool is None:
            return {}
        return {"limit": self.limit(), "weights": self.weights(), "counted": self.counted(),
                "budgets": dict(pool.budgets)}

    def view(self) -> list[LoadedModel]:
        """The counted models as room_to_load sees them: idle ones with their idle time, the others busy."""
        now = time.monotonic()
        return [LoadedModel(s.name, s.weights(),
                            None if not s.ready or s.unloading or self.busy(s.name) else now - s.last_used)
                for s in tuple(self.slots.values()) if s.counted]

    # --- the decisions ---

    async def load(self, slot: Slot) -> None:
        """Prepare `slot`'s model, decide its load and carry it out; a failure or a refusal is left in
        `slot.error` (its exception logged with its traceback)."""
        from ..models.sources import ModelError

        name = slot.name
        slot.counted = False
        try:
            path, slot.nbytes = await anyio.to_thread.run_sync(_prepare, name, self.config.models_dir)
        except Exception as e:  # ModelError: one line; anything else from a model file: still one, and its cause
            if not isinstance(e, ModelError):
                log.error("preparing model %s failed", name, exc_info=e)
            slot.error = f"the model {name} cannot be loaded: {e}"
            return
        async with self._deciding:
            await self._after_loads(slot)
            if (refusal := await self._unload_for(name, slot.nbytes)) is not None:
                slot.error, slot.refused = refusal, True
                return
            await self._rebudget(self.weights() + slot.nbytes)  # the caches make room first
            slot.counted = True
            log.info("loading model %s (%s of weights) on first use", name, human_bytes(slot.nbytes))
            engine = slot.engine = self.make(dataclasses.replace(self.config, model=name), path)
            engine.start()
            while not engine.ready.is_set():  # a threading.Event the engine thread sets
                await anyio.sleep(POLL)
            if (error := engine.load_error) is not None:
                log.error("loading model %s failed", name, exc_info=error)
                slot.error = f"the model {name} failed to load: {error}; kvd's log has the details"
                await anyio.to_thread.run_sync(engine.stop)
                slot.counted = False
            await self._rebudget(self.weights())  # its measured weights, in place of its footprint

    async def unload(self, name: str) -> bool:
        """Stop the model's engine (its caches paged out, its memory let go); False if it was not idle."""
        async with self._deciding:
            return await self._unload(name)

    async def expire(self, keep_alive: float, default: str) -> list[str]:
        """Unload every model but the default idle for `keep_alive` seconds or more; the ones unloaded."""
        gone = []
        for m in self.view():
            slot = self.slots.get(m.name)
            keep = slot.keep_alive if slot is not None and slot.keep_alive is not None else keep_alive
            if m.name != default and m.idle_s is not None and m.idle_s >= keep:
                log.info("unloading model %s: idle for %.0f s ([models] keep_alive)", m.name, m.idle_s)
                if await self.unload(m.name):
                    gone.append(m.name)
        return gone

    # --- under the lock ---

    async def _after_loads(self, slot: Slot) -> None:
        """Wait until no other engine is loading (the default's start-up load is not a decision of this one)."""
        while any(not s.engine.ready.is_set() for s in self.slots.values()
                  if s is not slot and s.engine is not None):
            await anyio.sleep(POLL)

    async def _unload_for(self, name: str, need: int) -> str | None:
        """Unload what room_to_load says (idle models, least recently used first); its refusal, if any."""
        room = room_to_load(name, need, self.limit(), [m for m in self.view() if m.name != name])
        if room.refusal is not None:
            return room.refusal
        for victim in room.unload:
            log.info("unloading model %s to make room for %s", victim, name)
            await self._unload(victim)
        return None

    async def _unload(self, name: str) -> bool:
        slot = self.slots.get(name)
        if slot is None or slot.engine is None or not slot.ready or slot.unloading or self.busy(name):
            return False
        slot.unloading = True
        try:
            await anyio.to_thread.run_sync(slot.engine.stop)  # its caches paged out, its store out of the pool
        finally:
            if self.slots.get(name) is slot:
                del self.slots[name]
            slot.gone.set()
        await self._rebudget(self.weights())  # the caches may take what its weights held
        return True

    async def _rebudget(self, weights: int) -> None:
        """The caches' budgets beside `weights` bytes of weights (daemon/device.py decides); when they
        shrink, wait until every model's caches are within them (each engine lets its least recently used
        go on its own thread, woken by the pool)."""
        from ..device import current

        pool = self.pool()
        if pool is None:
            return
        c = self.config
        resident, warm = current().cache_budgets(c.resident_bytes, c.warm_bytes, weights=weights, limit=self.limit())
        budgets = {RESIDENT: resident, WARM: warm}
        if budgets == {t: pool.budgets[t] for t in budgets}:
            return
        log.info("cache budgets (every loaded model's) beside %s of weights: resident %s, warm %s",
                 human_bytes(weights), human_bytes(resident), human_bytes(warm))
        pool.resize(budgets)
        t0 = time.monotonic()
        said = False
        while any(pool.over(t) for t in budgets):  # running answers' caches leave when their turns end
            if not said and time.monotonic() - t0 > SAY_WAITING:
                said = True
                log.info("waiting for the caches to fit their new budgets (%s over): the running answers hold "
                         "them", ", ".join(f"{t} {human_bytes(pool.over(t))}" for t in budgets if pool.over(t)))
            await anyio.sleep(POLL)
