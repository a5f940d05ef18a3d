"""How many turns an API request may queue behind: a bounded wait in arrival order, 429 past it.

The engine runs `limits.max_generations` turns at once and queues the
rest in arrival order. The HTTP door lets a request join only while fewer
than `max_generations + max_queued` turns are running or waiting; past
that it answers 429 in OpenAI's shape with `Retry-After`, before anything
is stored (OpenAI's clients wait and retry by themselves). That is the
back-pressure: a burst waits in order up to the depth, and the rest is
told when to come back instead of piling up connections.
"""

from __future__ import annotations

from http import HTTPStatus

from ..config import Config
from ..turns import Turns
from .openai_schema import ApiError

RETRY_AFTER_MIN = 1  # seconds


def admit(config: Config, turns: Turns) -> None:
    """Raise the 429 when the engine's queue is as deep as the config allows."""
    depth = config.max_generations + config.max_queued
    active = len(turns.active)
    if active < depth:
        return
    # A rough wait: every running generation ahead must end once per max_generations places.
    retry = max(RETRY_AFTER_MIN, (active - config.max_generations) // config.max_generations)
    raise ApiError(HTTPStatus.TOO_MANY_REQUESTS,
                   f"kvd is generating {config.max_generations} answers and {active - config.max_generations} "
                   f"more wait (limits.max_generations and limits.max_queued in config.toml); "
                   f"retry after {retry} s", code="rate_limit_exceeded", headers={"Retry-After": str(retry)})
