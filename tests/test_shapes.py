"""A turn's parameters, one rule each: config.toml, the websocket and the OpenAI door accept and refuse the
same values, each in its own words, because all three validate through protocol/shapes.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from common.limits import top_p_filters
from daemon.config import Config, ConfigError, load_config
from daemon.doors.httpdoor import ApiError
from daemon.doors.openai_schema import parse
from protocol.requests import ChatSend, RequestError, parse_request
from protocol.shapes import BAD_KEY, lone_surrogate

SID = "0123456789abcdef"
CONFIG = Config(model="builtin:tiny")  # max_tokens_limit 4096

# (field, value, accepted): the edges of every sampling range, and values of the wrong type.
EDGES: list[tuple[str, Any, bool]] = [
    ("max_tokens", 1, True), ("max_tokens", 4096, True), ("max_tokens", 0, False), ("max_tokens", 4097, False),
    ("max_tokens", 1.0, False), ("max_tokens", True, False), ("max_tokens", "5", False),
    ("temperature", 0, True), ("temperature", 2, True), ("temperature", 0.7, True), ("temperature", -0.01, False),
    ("temperature", 2.01, False), ("temperature", math.nan, False), ("temperature", math.inf, False),
    ("temperature", False, False),
    ("top_p", 1, True), ("top_p", 1e-9, True), ("top_p", 0, False), ("top_p", 1.01, False), ("top_p", "0.5", False),
]


def websocket(field: str, value: Any) -> bool:
    try:
        req = parse_request(json.dumps({"id": "a", "type": "chat.send", "session": SID, "text": "hi", field: value}),
                            CONFIG.request_limits())
    except RequestError as e:
        assert e.code == "bad_request" and repr(field) in e.message, e.message
        return False
    assert isinstance(req, ChatSend) and getattr(req.sampling, field) == value
    return True


def openai(field: str, value: Any) -> bool:
    try:
        parse({"messages": [{"role": "user", "content": "hi"}], field: value}, CONFIG)
    except ApiError as e:
        assert e.status == 400 and e.param == field, (e.param, e.message)
        return False
    return True


def config_file(tmp_path: Path, field: str, value: Any) -> bool:
    path = tmp_path / "c.toml"
    toml = ("true" if value else "false") if isinstance(value, bool) else json.dumps(value)
    path.write_text(f"[generation]\n{field} = {toml.replace('NaN', 'nan').replace('Infinity', 'inf')}\n")
    try:
        load_config(path)
    except ConfigError as e:
        assert str(e).startswith(f"generation.{field} must "), e
        return False
    return True


@pytest.mark.parametrize("field, value, accepted", EDGES)
def test_every_door_draws_the_same_line(tmp_path: Path, field: str, value: Any, accepted: bool) -> None:
    # An HTTP door's output limit is a ceiling (daemon/doors/rules.py): above the limit it is lowered, not refused.
    http = accepted or (field == "max_tokens" and isinstance(value, int) and not isinstance(value, bool) and value > 0)
    assert (websocket(field, value), openai(field, value), config_file(tmp_path, field, value)) == (
        accepted, http, accepted)


def test_session_params_take_the_same_values() -> None:
    for field, value, accepted in EDGES:
        frame = json.dumps({"id": 1, "type": "session.update", "session": SID, "params": {field: value}})
        try:
            parse_request(frame, CONFIG.request_limits())
        except RequestError as e:
            assert not accepted and e.code == "bad_request", (field, value)
        else:
            assert accepted, (field, value)


def test_the_text_bound_is_one_rule() -> None:
    limit = CONFIG.max_text_chars
    for text, fits in (("x" * limit, True), ("x" * (limit + 1), False)):
        try:
            parse_request(json.dumps({"id": "a", "type": "chat.send", "session": SID, "text": text}),
                          CONFIG.request_limits())
        except RequestError as e:
            assert not fits and (e.code, e.message) == ("too_large", f"'text' is longer than {limit} characters")
        else:
            assert fits
        try:
            parse({"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}, CONFIG)
        except ApiError as e:
            assert not fits and (e.param, e.code) == ("messages[0].content", "string_above_max_length")
        else:
            assert fits


def test_the_config_bounds_its_own_default_by_its_own_limit(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[limits]\nmax_tokens_limit = 256\n")  # below generation.max_tokens' default, 512
    with pytest.raises(ConfigError, match=r"^generation.max_tokens must not exceed limits.max_tokens_limit"):
        load_config(path)
    path.write_text("[limits]\nmax_tokens_limit = 256\n[generation]\nmax_tokens = 256\n")
    assert load_config(path).max_tokens == 256


def test_top_p_of_one_is_off() -> None:
    assert [top_p_filters(p) for p in (1.0, 0.999, 0.5, 1e-9)] == [False, True, True, True]


def test_the_surrogate_guard_names_the_path() -> None:
    assert lone_surrogate({"a": ["ok", {"b": "x\ud800"}]}) == ("a", 1, "b")
    assert lone_surrogate({"a": {"\udfff": 1}}) == ("a", BAD_KEY)
    assert lone_surrogate({"a": ["\U0001f600", {"b": None}]}) is None
    deep: Any = "\ud800"
    for _ in range(100_000):  # iterative: no recursion limit
        deep = [deep]
    assert lone_surrogate(deep) == (0,) * 100_000
