"""Many models, one daemon: one engine thread per loaded model, loaded by name on first use.

Each loaded model is an `Engine` (thread.py) exactly as a single-model daemon
has one: its own thread, which owns that model and every MLX array of it, its
own decode batch and its own cache tiers, whose byte budgets every loaded model
shares (cachestore's `Pool`, made by the first engine). This registry, on the event loop,
says which names mean which model (`resolve`), hands a turn its model's engine (`engine`), and shows
what is loaded (`loaded`). Whether and when a model loads or unloads, and what the caches' budgets
are meanwhile, is the daemon's one memory decision-maker's (memory.py): one decision at a time,
counting what a loading model will hold and what an unloading one holds until its engine has
stopped. A model that is answering or loading is never unloaded; loading one never stops another's
answers, since each runs on its own thread. A load that fails logs its exception with its traceback;
its waiting requests get one line.

The model kvd starts with (`--model`, config's `model`) is the default: what a
request that names no model gets. It is loaded at start as before; after that it
is a model like the others, except that keep_alive does not unload it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskGroup

import protocol as p
from protocol.requests import RequestError, RequestId

from ..config import Config
from ..models.catalog import SERVED_ALIAS, model_names
from .memory import Memory, Slot
from .thread import Engine

if TYPE_CHECKING:
    from cachestore import Pool

log = logging.getLogger("kvd.models")

__all__ = ["Engines", "ModelRefused"]

NAMES_FRESH = 10.0  # seconds a listing of the servable models is reused before it is walked again
ANNOUNCE = 1.0  # seconds between `loading` events while a model loads
KEEP_ALIVE_CHECK = 5.0  # seconds between looks for models idle past keep_alive, at most
KEEP_ALIVE_MIN_CHECK = 0.5  # and at least


class ModelRefused(Exception):
    """The model cannot be loaded now: `too_large` when there is no room for it (room_to_load's line),
    `unknown_model` when it cannot be loaded at all (its files, a sharded kvd)."""

    def __init__(self, message: str, code: str = p.UNKNOWN_MODEL) -> None:
        super().__init__(message)
        self.code = code


def _servable(models_dir: Path) -> list[str]:
    """What `kvd models` lists and says runs (a worker thread: it walks Ollama's and the HF cache's folders)."""
    from ..models.catalog import entries

    return [e.name for e in entries(models_dir) if e.runs.startswith("yes")]


class Engines:
    """The loaded models by name; the turn core asks it for a session's model's engine."""

    def __init__(self, config: Config, first: Engine, *, busy: Callable[[str], bool] = lambda name: False,
                 make: Callable[[Config, Path], Engine] | None = None) -> None:
        """`first`: the default model's engine (started by `kvd serve`). `busy(name)`: whether a turn
        runs on that model now (the turn core knows). `make`: an engine for a config and a prepared
        model directory (tests make their own)."""
        self.default = config.model
        self._busy = busy
        self._slots: dict[str, Slot] = {self.default: Slot(self.default, first)}
        # The start-up load is not the registry's: kvd serve started it, doors/loading.py watches it,
        # and the turn core waits for its `ready` as a single-model daemon does.
        self._slots[self.default].settled.set()
        self._pool: Pool | None = None
        # Every engine's caches share one pair of memory budgets (cachestore's Pool), the first engine's.
        self.memory = Memory(config, self._slots, busy=busy, pool=self.pool,
                             make=make or (lambda c, path: Engine(c, model_dir=path, pool=self.pool())))
        self.config = config
        self._names: tuple[float, dict[str, str]] | None = None
        self.tg: TaskGroup | None = None  # the daemon's; loads run in it
        #: Daemon events to every websocket client (the server sets it): `loading` while a model loads.
        self.broadcast: Callable[[dict[str, Any]], None] = lambda event: None

    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        """A new config (tests swap one in: keep_alive, the budgets) reaches the memory decisions too."""
        self._config = self.memory.config = config

    # --- names ---

    def alias(self, name: str) -> str:
        return dict(self.config.aliases).get(name, name)

    def is_known(self, name: str) -> bool:
        """Whether a name means a model without a listing: the default's names, an alias, a loaded model."""
        return name == SERVED_ALIAS or self.alias(name) in self._slots or name in model_names(self.default)

    async def resolve(self, name: str | None, rid: RequestId = None) -> str:
        """The model a request's `model` names (None, "" and "kvd": the default), or RequestError
        UNKNOWN_MODEL for a name kvd cannot serve."""
        if not name or name == SERVED_ALIAS or name in model_names(self.default):
            return self.default
        name = self.alias(name)
        if name in self._slots:
            return name
        found = (await self.names()).get(name)
        if found is None:
            raise RequestError(p.UNKNOWN_MODEL, f"kvd cannot serve a model named {name!r}: `kvd models` lists "
                               f"the models it can (the default, {self.default!r}, is also {SERVED_ALIAS!r}), "
                               "and [models] aliases in config.toml adds names", rid)
        return found

    async def names(self) -> dict[str, str]:
        """Every name a request may use, to the model it means (the listing is walked at most every
        NAMES_FRESH seconds)."""
        now = time.monotonic()
        if self._names is None or now - self._names[0] > NAMES_FRESH:
            models = await anyio.to_thread.run_sync(_servable, self.config.models_dir)
            names: dict[str, str] = {}
            for model in [*models, *self._slots]:
                for n in model_names(model):
                    names.setdefault(n, model)
            for alias, model in self.config.aliases:
                names[alias] = model
            names.update({n: self.default for n in model_names(self.default)})
            self._names = (now, names)
        return self._names[1]

    async def servable(self) -> list[str]:
        """Every model a request may name, the default first (what /v1/models lists)."""
        models = sorted(set((await self.names()).values()) - {self.default})
        return [self.default, *models]

    # --- engines ---

    def get(self, name: str) -> Engine | None:
        """The model's engine if it is loaded (or loading); None otherwise."""
        slot = self._slots.get(name)
        return slot.engine if slot is not None else None

    def pool(self) -> Pool | None:
        """The memory budgets the loaded models' caches share: made by the first engine to load, and the
        daemon's from then on (every later engine joins it, even once that first one has unloaded)."""
        if self._pool is None:
            self._pool = next((e.pool for e in self.engines() if e.pool is not None), None)
        return self._pool

    def engines(self) -> list[Engine]:
        return [s.engine for s in self._slots.values() if s.engine is not None]

    @property
    def default_engine(self) -> Engine | None:
        return self.get(self.default)

    def used(self, name: str) -> None:
        """A turn on `name` began or ended: its idle time counts from now."""
        if (slot := self._slots.get(name)) is not None:
            slot.last_used = time.monotonic()

    async def engine(self, name: str) -> Engine:
        """The loaded engine of `name`, loading it first (the caller waits); ModelRefused when it cannot be."""
        slot = self._slots.get(name)
        while slot is not None and slot.unloading:  # its bytes are free once its engine has stopped: then load
            await slot.gone.wait()
            slot = self._slots.get(name)
        if slot is None and self.config.world_size > 1:
            raise ModelRefused(f"this kvd splits {self.default} across {self.config.world_size} ranks and serves "
                               f"only it; start another kvd for {name}")
        if slot is None:
            slot = self._slots[name] = Slot(name)
            assert self.tg is not None, "the daemon is not serving"
            self.tg.start_soon(self._load, slot)
        await slot.settled.wait()
        if slot.error is not None:
            raise ModelRefused(slot.error, p.TOO_LARGE if slot.refused else p.UNKNOWN_MODEL)
        self.used(name)
        assert slot.engine is not None
        return slot.engine

    async def _load(self, slot: Slot) -> None:
        """Load `slot`'s model (its waiters wait on `settled`), telling every client how long it takes."""
        t0 = time.monotonic()
        try:
            async with anyio.create_task_group() as announcing:
                announcing.start_soon(self._announce, slot.name, t0)
                try:
                    await self.memory.load(slot)
                except Exception as e:  # never a waiter left without an answer, nor a load without its cause
                    log.exception("loading model %s failed", slot.name)
                    slot.error = f"the model {slot.name} failed to load: {e}; kvd's log has the details"
                finally:
                    announcing.cancel_scope.cancel()
            if slot.error is None:
                log.info("model %s loaded in %.1f s (%s of weights)", slot.name, time.monotonic() - t0,
                         _size(slot.weights()))
                self.broadcast({"type": p.READY, "model": slot.name})
        finally:
            if slot.error is not None:
                log.warning("%s", slot.error)
                if self._slots.get(slot.name) is slot:
                    del self._slots[slot.name]  # a later request tries again
            slot.last_used = time.monotonic()
            slot.settled.set()

    async def _announce(self, name: str, t0: float) -> None:
        """A `loading` event about once a second (fetching, converting, loading, warming up), as at start;
        none for a load (or a refusal) quicker than that."""
        while True:
            await anyio.sleep(ANNOUNCE)
            self.broadcast({"type": p.LOADING, "model": name, "stage": f"loading {name}",
                            "elapsed_s": round(time.monotonic() - t0, 1)})

    async def unload(self, name: str) -> bool:
        """Stop the model's engine (its caches paged out, its memory let go); False if it was not idle."""
        return await self.memory.unload(name)

    def keep(self, name: str, seconds: float) -> None:
        """How long `name` stays loaded once idle, as a request asked (Ollama's keep_alive; inf: until another
        model needs its memory); the default model stays loaded whatever is asked."""
        if (slot := self._slots.get(name)) is not None:
            slot.keep_alive = seconds

    def _keep_alive(self, name: str) -> float:
        slot = self._slots.get(name)
        return slot.keep_alive if slot is not None and slot.keep_alive is not None else self.config.keep_alive

    async def keep_alive(self) -> None:
        """Unload every model but the default once it has been idle for [models] keep_alive seconds."""
        while True:
            await anyio.sleep(min(KEEP_ALIVE_CHECK, max(KEEP_ALIVE_MIN_CHECK, self.config.keep_alive / 2)))
            await self.expire()

    async def expire(self) -> list[str]:
        """One look for models idle past keep_alive (the default stays); the ones unloaded."""
        return await self.memory.expire(self.config.keep_alive, self.default)

    # --- what `kvd ps` and /v1/models show ---

    def loaded(self) -> list[dict[str, Any]]:
        """One object per loaded or loading model (`kvd ps`; `status`'s "models")."""
        now = time.monotonic()
        out = []
        for s in self._slots.values():
            e = s.engine
            state = ("unloading" if s.unloading else "loading" if not s.ready
                     else "answering" if self._busy(s.name) else "idle")
            idle = round(now - s.last_used, 1) if state == "idle" else None
            keep = self._keep_alive(s.name)
            expires = (None if s.name == self.default or idle is None or keep == float("inf")
                       else round(max(0.0, keep - idle), 1))
            out.append({"model": s.name, "default": s.name == self.default, "state": state,
                        "weights_bytes": s.weights(), "context_length": e.max_context if e is not None else None,
                        "idle_s": idle, "unloads_in_s": expires, "device": e.device if e is not None else None,
                        "cache": _cache_of(e.stats if e is not None else {})})
        return out


def _cache_of(stats: dict[str, Any]) -> dict[str, Any] | None:
    """A loaded model's cache, as `kvd ps` and /v1/models show it: its layers by kind (`arrays`: recurrent or
    linear-attention state; `rotating`: a sliding window), the bytes of one checkpoint of the state those keep (0:
    the cache can be cut anywhere, none is kept), how many a session keeps, and the bytes of those held now."""
    points = stats.get("tiers", {}).get("checkpoints")
    if not points:
        return None  # (the model is loading)
    return {"kinds": points["kinds"], "checkpoint_bytes": points["each_bytes"], "checkpoints_per_session":
            points["keep"] if points["each_bytes"] else 0, "checkpoints_held_bytes": points["bytes"]}


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
