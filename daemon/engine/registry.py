"""Many models, one daemon: one engine thread per loaded model, loaded by name on first use.

Each loaded model is an `Engine` (thread.py) exactly as a single-model daemon
has one: its own thread, which owns that model and every MLX array of it, its
own decode batch and its own cache tiers, whose byte budgets every loaded model
shares (cachestore's `Pool`, made by the first engine). This registry, on the event loop,
says which names mean which model (`resolve`), loads a model the first time a
turn asks for it (`engine`), and unloads one: when another needs its memory
(daemon/device.py's `make_room` decides, before a weight is read) or after
[models] keep_alive seconds without a turn (`keep_alive`). A model that is
answering or loading is never unloaded; loading one never stops another's
answers, since each runs on its own thread.

The model kvd starts with (`--model`, config's `model`) is the default: what a
request that names no model gets. It is loaded at start as before; after that it
is a model like the others, except that keep_alive does not unload it.
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
from anyio.abc import TaskGroup

import protocol as p
from protocol.requests import RequestError, RequestId

from ..config import Config
from ..device import LoadedModel, make_room
from ..models.catalog import SERVED_ALIAS, model_names
from .thread import Engine

if TYPE_CHECKING:
    from cachestore import Pool

log = logging.getLogger("kvd.models")

__all__ = ["Engines", "ModelRefused"]

NAMES_FRESH = 10.0  # seconds a listing of the servable models is reused before it is walked again
POLL = 0.05  # seconds between looks at a loading engine's `ready` (a threading.Event)
ANNOUNCE = 1.0  # seconds between `loading` events while a model loads
KEEP_ALIVE_CHECK = 5.0  # seconds between looks for models idle past keep_alive, at most
KEEP_ALIVE_MIN_CHECK = 0.5  # and at least


class ModelRefused(Exception):
    """The model cannot be loaded now: `too_large` when there is no room for it (make_room's line),
    `unknown_model` when it cannot be loaded at all (its files, a sharded kvd)."""

    def __init__(self, message: str, code: str = p.UNKNOWN_MODEL) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Slot:
    """One model the registry holds: loading (engine None or not ready) or loaded."""

    name: str
    engine: Engine | None = None
    nbytes: int = 0  # its weights' bytes: estimated before the load, measured after it
    last_used: float = field(default_factory=time.monotonic)
    settled: anyio.Event = field(default_factory=anyio.Event)  # the load ended, loaded or failed
    error: str | None = None
    refused: bool = False  # the error is "no room" (too_large), not "cannot be loaded"

    @property
    def ready(self) -> bool:
        """Loaded and answering turns (a failed load is never ready)."""
        e = self.engine
        return self.error is None and e is not None and e.ready.is_set() and e.load_error is None


def _servable(models_dir: Path) -> list[str]:
    """What `kvd models` lists and says runs (a worker thread: it walks Ollama's and the HF cache's folders)."""
    from ..models.catalog import entries

    return [e.name for e in entries(models_dir) if e.runs.startswith("yes")]


def _prepare(name: str, models_dir: Path) -> tuple[Path, int]:
    """The model's directory (fetched and converted first if needed) and its weights' bytes as the device
    will run them (a worker thread)."""
    from ..device import current
    from ..models.footprint import weights_bytes
    from ..models.sources import prepare_model

    path = prepare_model(name, models_dir)
    return path, weights_bytes(path, current().weights_dtype)


class Engines:
    """The loaded models by name; the turn core asks it for a session's model's engine."""

    def __init__(self, config: Config, first: Engine, *, busy: Callable[[str], bool] = lambda name: False,
                 make: Callable[[Config, Path], Engine] | None = None) -> None:
        """`first`: the default model's engine (started by `kvd serve`). `busy(name)`: whether a turn
        runs on that model now (the turn core knows). `make`: an engine for a config and a prepared
        model directory (tests make their own)."""
        self.config = config
        self.default = config.model
        self._busy = busy
        # Every engine's caches share one pair of memory budgets (cachestore's Pool), the first engine's.
        self._make = make or (lambda c, path: Engine(c, model_dir=path, pool=self.pool()))
        self._slots: dict[str, Slot] = {self.default: Slot(self.default, first)}
        # The start-up load is not the registry's: kvd serve started it, doors/loading.py watches it,
        # and the turn core waits for its `ready` as a single-model daemon does.
        self._slots[self.default].settled.set()
        self._names: tuple[float, dict[str, str]] | None = None
        self.tg: TaskGroup | None = None  # the daemon's; loads run in it
        #: Daemon events to every websocket client (the server sets it): `loading` while a model loads.
        self.broadcast: Callable[[dict[str, Any]], None] = lambda event: None

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
        """The memory budgets the loaded models' caches share (made by the first engine to load)."""
        return next((e.pool for e in self.engines() if e.pool is not None), None)

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
                    await self._load_now(slot)
                finally:
                    announcing.cancel_scope.cancel()
            if slot.error is None:
                log.info("model %s loaded in %.1f s (%s of weights)", slot.name, time.monotonic() - t0,
                         _size(slot.nbytes))
                self.broadcast({"type": p.READY, "model": slot.name})
        finally:
            if slot.error is not None:
                log.warning("%s", slot.error)
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

    async def _load_now(self, slot: Slot) -> None:
        """Prepare the model, make room for it, start its engine and wait until it is ready; a failure or a
        refusal is left in `slot.error`."""
        name = slot.name
        try:
            path, slot.nbytes = await anyio.to_thread.run_sync(_prepare, name, self.config.models_dir)
        except Exception as e:  # ModelError: one line; anything else from a model file: still one
            slot.error = f"the model {name} cannot be loaded: {e}"
            return
        if (refusal := await self._make_room(name, slot.nbytes)) is not None:
            slot.error, slot.refused = refusal, True
            return
        log.info("loading model %s (%s of weights) on first use", name, _size(slot.nbytes))
        engine = slot.engine = self._make(dataclasses.replace(self.config, model=name), path)
        engine.start()
        while not engine.ready.is_set():  # a threading.Event the engine thread sets
            await anyio.sleep(POLL)
        if engine.load_error is not None:
            slot.error = f"the model {name} failed to load: {engine.load_error}; kvd's log has the details"
            await anyio.to_thread.run_sync(engine.stop)
            return
        slot.nbytes = engine.weights_bytes or slot.nbytes

    def _view(self) -> list[LoadedModel]:
        now = time.monotonic()
        return [LoadedModel(s.name, self._bytes(s),
                            None if not s.ready or self._busy(s.name) else now - s.last_used)
                for s in self._slots.values()]

    def _bytes(self, slot: Slot) -> int:
        if slot.engine is not None and slot.engine.weights_bytes is not None:
            return slot.engine.weights_bytes
        return slot.nbytes

    async def _make_room(self, name: str, need: int) -> str | None:
        """Unload what make_room says (idle models, least recently used first); its refusal, if any."""
        from ..device import current

        others = [m for m in self._view() if m.name != name]
        room = make_room(name, need, current().models_memory(self.config.models_memory), others)
        if room.refusal is not None:
            return room.refusal
        for victim in room.unload:
            log.info("unloading model %s to make room for %s", victim, name)
            await self.unload(victim)
        return None

    async def unload(self, name: str) -> bool:
        """Stop the model's engine (its caches paged out, its memory let go); False if it was not idle."""
        slot = self._slots.get(name)
        if slot is None or slot.engine is None or not slot.ready or self._busy(name):
            return False
        del self._slots[name]
        await anyio.to_thread.run_sync(slot.engine.stop)
        return True

    async def keep_alive(self) -> None:
        """Unload every model but the default once it has been idle for [models] keep_alive seconds."""
        while True:
            await anyio.sleep(min(KEEP_ALIVE_CHECK, max(KEEP_ALIVE_MIN_CHECK, self.config.keep_alive / 2)))
            await self.expire()

    async def expire(self) -> list[str]:
        """One look for models idle past keep_alive (the default stays); the ones unloaded."""
        gone = []
        for m in self._view():
            if m.name != self.default and m.idle_s is not None and m.idle_s >= self.config.keep_alive:
                log.info("unloading model %s: idle for %.0f s ([models] keep_alive)", m.name, m.idle_s)
                if await self.unload(m.name):
                    gone.append(m.name)
        return gone

    # --- what `kvd ps` and /v1/models show ---

    def loaded(self) -> list[dict[str, Any]]:
        """One object per loaded or loading model (`kvd ps`; `status`'s "models")."""
        now = time.monotonic()
        out = []
        for s in self._slots.values():
            e = s.engine
            state = "loading" if not s.ready else "answering" if self._busy(s.name) else "idle"
            idle = round(now - s.last_used, 1) if state == "idle" else None
            expires = (None if s.name == self.default or idle is None or self.config.keep_alive == float("inf")
                       else round(max(0.0, self.config.keep_alive - idle), 1))
            out.append({"model": s.name, "default": s.name == self.default, "state": state,
                        "weights_bytes": self._bytes(s), "context_length": e.max_context if e is not None else None,
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
