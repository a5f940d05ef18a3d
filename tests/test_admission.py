"""The API door's queue depth counts requests from their admission, not from their turn's start."""

from __future__ import annotations

from dataclasses import replace
from http import HTTPStatus
from types import SimpleNamespace
from typing import cast

import pytest

from daemon.config import Config
from daemon.doors.admission import Admission
from daemon.doors.httpdoor import ApiError
from daemon.turns import Turns


def door(running: int = 0) -> tuple[Admission, dict[str, object]]:
    active: dict[str, object] = {f"s{i}": object() for i in range(running)}
    config = replace(Config(), max_generations=2, max_queued=3)
    return Admission(config, cast(Turns, SimpleNamespace(active=active))), active


def test_requests_being_prepared_hold_their_places() -> None:
    """A burst that arrives at once: each request still decoding or being placed holds a place, so
    the sixth is refused although no turn has started yet (CI once saw 60 of 60 admitted)."""
    admission, _ = door()
    held = [admission.slot() for _ in range(5)]
    for slot in held:
        slot.__enter__()
    with pytest.raises(ApiError) as refused:
        with admission.slot():
            pass
    assert refused.value.status == HTTPStatus.TOO_MANY_REQUESTS
    assert refused.value.headers == {"Retry-After": "1"}
    for slot in held:
        slot.__exit__(None, None, None)
    assert admission.pending == 0
    with admission.slot():
        assert admission.pending == 1


def test_a_place_passes_to_the_running_turn_and_is_freed_by_a_refusal() -> None:
    admission, active = door(running=4)
    with admission.slot():
        active["new"] = object()  # its turn started: counted in turns.active from here
    assert admission.pending == 0
    with pytest.raises(ApiError):
        with admission.slot():
            pass
    del active["new"]
    with pytest.raises(RuntimeError):
        with admission.slot():
            raise RuntimeError("placement failed")
    assert admission.pending == 0  # a request that failed gave its place back
