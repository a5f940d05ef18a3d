"""JSON schemas as hostile input (issue 35), against a real `kvd serve`: a schema too big, one past what
llguidance's parser can hold, and ones no finite JSON satisfies are each a 400 naming
``response_format.json_schema.schema`` (the Responses door's ``text.format.schema``) that stores nothing,
while another client's websocket pings stay fast beside them (compiled on a worker within a deadline:
daemon/doors/jsonoutput.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from daemonproc import DaemonProcess
from test_hostile_http import HI, RHI, beside_pings, daemon, post, stored

__all__ = ["daemon"]  # the module's daemon, shared with test_hostile_http's fixture


def props(n: int, *, required: bool = False, description: str = "") -> dict[str, Any]:
    extra = {"description": description} if description else {}
    schema: dict[str, Any] = {"type": "object",
                              "properties": {f"p{i}": {"type": "integer", **extra} for i in range(n)}}
    if required:
        schema["required"] = list(schema["properties"])
    return schema


def asking(schema: Any, door: str = "chat") -> dict[str, Any]:
    if door == "responses":
        return {**RHI, "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}
    return {**HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


PARAM = {"chat": "response_format.json_schema.schema", "responses": "text.format.schema"}


SCHEMAS: list[tuple[str, Any, str]] = [
    ("10,000 optional properties", props(10_000), "more than kvd compiles"),
    ("10,000 required properties", props(10_000, required=True), "more than kvd compiles"),
    ("an enum of 50,000", {"enum": [f"v{i}" for i in range(50_000)]}, "more than kvd compiles"),
    ("900 KB of 1,000 described properties", props(1_000, description="d" * 880), "more than kvd compiles"),
    ("2,000 optional properties (past the parser's row limit)", props(2_000), "cannot hold an answer"),
    ("$ref: #", {"$ref": "#"}, "no finite JSON"),
    ("a -> b -> a", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "no finite JSON"),
    ("an allOf cycle", {"allOf": [{"$ref": "#"}]}, "no finite JSON"),
    ("a required property that is the schema itself",
     {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "no finite JSON"),
]


@pytest.mark.parametrize("door", list(PARAM))
@pytest.mark.parametrize("case, schema, says", SCHEMAS, ids=[s[0] for s in SCHEMAS])
def test_a_schema_kvd_cannot_hold_is_a_400_that_stores_nothing_and_stalls_no_one(
        daemon: DaemonProcess, case: str, schema: Any, says: str, door: str) -> None:
    content = json.dumps(asking(schema, door)).encode()
    assert len(content) < 1 << 20  # under the body limit: the schema itself is what is refused
    before = stored(daemon)

    def request() -> None:
        r = post(daemon, content, door=door)
        error = r.json().get("error", {})
        assert r.status_code == 400, (case, r.status_code, r.text[:300])
        assert error.get("param") == PARAM[door] and says in error["message"], error

    beside_pings(daemon, case, request, at_least=3, seconds=3.0)
    assert stored(daemon) == before


def test_a_recursive_schema_that_can_end_is_still_followed(daemon: DaemonProcess) -> None:
    tree = {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 0}},
            "required": ["children"], "additionalProperties": False}
    r = post(daemon, {**asking(tree), "max_tokens": 40, "temperature": 0})
    assert r.status_code == 200, r.text[:300]
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert json.loads(choice["message"]["content"]) == {"children": []}
