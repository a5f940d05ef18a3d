"""How many turns an API request may queue behind: a bounded wait in arrival order, 429 past it.

The engine runs `limits.max_generations` turns at once and queues the
rest in arrival order. The HTTP door lets a request join only while fewer
than `max_generations + max_queued` turns are running or waiting; past
that it answers 429 in OpenAI's shape with `Retry-After`, before anything
is stored (OpenAI's clients wait and retry by themselves). That is the
back-pressure: a burst waits in order up to the depth, and the rest is
told when to come back instead of piling up connections.

A request is counted from the moment it is admitted, not from the moment
its turn starts: between the two it decodes, compiles its grammar and is
placed on worker threads, and a burst that arrives at once would otherwise
all pass the check before any of its turns is running.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus

from ..config import Config
from ..turns import Turns
from .httpdoor import ApiError

RETRY_AFTER_MIN = 1  # seconds


class Admission:
    """The door's count of requests admitted whose turns have not started yet."""

    def __init__(self, config: Config, turns: Turns):
        self.config = config
        self.turns = turns
        self.pending = 0

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold a place in the queue while the request is prepared; 429 when there is none.

        The place is the request's until the block ends: by then its turn is
        in `turns.active` (and counted there), or the request was refused."""
        admit(self.config, len(self.turns.active) + self.pending)
        self.pending += 1
        try:
            yield
        finally:
            self.pending -= 1


def admit(config: Config, active: int) -> None:
    """Raise the 429 when `active` turns (running, waiting, or admitted and being prepared) fill the queue."""
    depth = config.max_generations + config.max_queued
    if active < depth:
        return
    # A rough wait: every running generation ahead must end once per max_generations places.
    retry = max(RETRY_AFTER_MIN, (active - config.max_generations) // config.max_generations)
    raise ApiError(HTTPStatus.TOO_MANY_REQUESTS,
                   f"kvd is generating {config.max_generations} answers and {active - config.max_generations} "
                   f"more wait (limits.max_generations and limits.max_queued in config.toml); "
                   f"retry after {retry} s", code="rate_limit_exceeded", headers={"Retry-After": str(retry)})
