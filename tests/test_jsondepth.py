"""One nesting limit for every JSON kvd reads, whatever the Python (common/jsondepth.py)."""

from __future__ import annotations

import json

import pytest

from common.jsondepth import MAX_DEPTH, NestedTooDeep, loads, too_deep

pytestmark = pytest.mark.unit


def nested(levels: int) -> str:
    return '{"y": ' * (levels - 1) + "[1]" + "}" * (levels - 1)


def test_the_limit_is_exact() -> None:
    assert loads(nested(MAX_DEPTH)) is not None
    with pytest.raises(NestedTooDeep):
        loads(nested(MAX_DEPTH + 1))
    with pytest.raises(RecursionError):  # every `except RecursionError` already answers it
        loads(nested(MAX_DEPTH + 1).encode())


def test_depth_counts_lists_and_objects_not_their_width() -> None:
    assert not too_deep([[1], [2], {"a": [3]}], 3)
    assert too_deep([[1], [2], {"a": [[3]]}], 3)
    wide = json.dumps([{"role": "user", "content": [{"type": "text"}]}] * 10_000)
    assert loads(wide)[0]["content"][0]["type"] == "text"


def test_what_python_cannot_parse_still_raises_recursion_error() -> None:
    with pytest.raises(RecursionError):
        loads("[" * 100_000 + "]" * 100_000)
