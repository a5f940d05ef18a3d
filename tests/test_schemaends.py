"""Which schemas some finite JSON value satisfies (daemon/doors/schemaends.py): refuse only what cannot end."""

from __future__ import annotations

from typing import Any

import pytest

from daemon.doors.schemaends import has_finite_value

SELF = {"$ref": "#"}
CASES: list[tuple[str, Any, bool]] = [
    ("$ref: #", SELF, False),
    ("a -> b -> a", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, False),
    ("an allOf cycle", {"allOf": [SELF]}, False),
    ("a required property that is the schema", {"type": "object", "properties": {"a": SELF}, "required": ["a"]},
     False),
    ("an array of at least one of itself", {"type": "array", "items": SELF, "minItems": 1}, False),
    ("false", False, False),
    ("an optional property that is the schema", {"type": "object", "properties": {"a": SELF}}, True),
    ("a tree whose children may be none", {"type": "object", "properties": {
        "children": {"type": "array", "items": SELF}}, "required": ["children"]}, True),
    ("anyOf with a way out", {"anyOf": [SELF, {"type": "string"}]}, True),
    ("a ref to a definition that ends", {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"}, True),
    ("a ref kvd cannot resolve (llguidance says)", {"$ref": "https://example.com/s.json"}, True),
    ("any value", {}, True),
    ("an ordinary object", {"type": "object", "properties": {"size": {"enum": ["s", "m"]}}, "required": ["size"]},
     True),
]


@pytest.mark.parametrize("case, schema, ends", CASES, ids=[c[0] for c in CASES])
def test_a_schema_has_a_finite_value_unless_its_cycles_cannot_end(case: str, schema: Any, ends: bool) -> None:
    assert has_finite_value(schema) is ends
