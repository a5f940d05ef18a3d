"""Which max_tokens, temperature and top_p a turn runs with, and how a session's change to them merges.

A request's own value wins; then the session's params (set with
session.update); then the config's default. The rule lives here, in one
place, so chat.send, chat.regenerate and chat.edit cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import Config


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float


def resolve(
    config: Config,
    session_params: Mapping[str, Any],
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
) -> Sampling:
    """The request's values, else the session's, else the config's.

    A session's max_tokens was checked against max_tokens_limit when it was
    set; the limit may have been lowered since, so it is clamped here.
    """

    def pick(requested: Any, name: str, default: Any) -> Any:
        if requested is not None:
            return requested
        stored = session_params.get(name)
        return default if stored is None else stored

    tokens = min(int(pick(max_tokens, "max_tokens", config.max_tokens)), config.max_tokens_limit)
    return Sampling(
        max_tokens=tokens,
        temperature=float(pick(temperature, "temperature", config.temperature)),
        top_p=float(pick(top_p, "top_p", config.top_p)),
    )


def merge(current: Mapping[str, Any], change: Mapping[str, Any]) -> dict[str, Any]:
    """`current` with `change` applied: a value sets its key, None removes it."""
    merged = dict(current)
    for key, value in change.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged
