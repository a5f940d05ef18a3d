"""Whether some finite JSON value satisfies a schema: the cycles llguidance would follow forever.

A schema whose ``$ref``s only lead to each other (``{"$ref": "#"}``,
``a -> b -> a``, an ``allOf`` that contains itself) or whose required
property is the schema itself (``{"type": "object", "properties": {"a":
{"$ref": "#"}}, "required": ["a"]}``) describes no finite value: an answer
held to it can only end when max_tokens cuts it, or not begin at all. The
door refuses such a schema (jsonoutput.py); the dry run there finds the
first kind too, this finds the ones that need a few levels of an answer.

A least fixpoint: every subschema starts as "no value known"; one is
marked satisfiable once what it requires is (its ``$ref`` target, all of
its ``allOf``, one of its ``anyOf``/``oneOf``; for an object type, each
required property; for an array type, the items its ``minItems`` asks for).
Whatever is still unmarked when nothing changes has no finite value.
Conservative: a keyword it does not model counts as satisfiable, so it only
refuses what certainly cannot end.
"""

from __future__ import annotations

from typing import Any

__all__ = ["has_finite_value"]


def has_finite_value(schema: Any) -> bool:
    """False only when no finite JSON value can satisfy `schema` (see the module docstring)."""
    nodes: dict[int, Any] = {}
    todo = [schema]
    while todo:  # every subschema, by identity
        node = todo.pop()
        if id(node) in nodes or not isinstance(node, (dict, bool)):
            continue
        nodes[id(node)] = node
        if isinstance(node, dict):
            todo += _children(node, schema)
    ok: set[int] = set()
    changed = True
    while changed:
        changed = False
        for key, node in nodes.items():
            if key not in ok and _satisfiable(node, schema, ok):
                ok.add(key)
                changed = True
    return id(schema) in ok


def _children(node: dict[str, Any], root: Any) -> list[Any]:
    out: list[Any] = []
    for word in ("allOf", "anyOf", "oneOf", "prefixItems"):
        if isinstance(node.get(word), list):
            out += node[word]
    for word in ("properties", "$defs", "definitions"):
        if isinstance(node.get(word), dict):
            out += node[word].values()
    for word in ("items", "additionalProperties", "not", "if", "then", "else"):
        if isinstance(node.get(word), (dict, bool)):
            out.append(node[word])
    if (target := _target(node, root)) is not None:
        out.append(target)
    return out


def _target(node: dict[str, Any], root: Any) -> Any:
    """The subschema a local ``$ref`` names (``#``, ``#/$defs/x``, any JSON pointer into the root); else None."""
    ref = node.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    here = root
    for part in (p for p in ref[1:].split("/") if p):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(here, dict) and part in here:
            here = here[part]
        elif isinstance(here, list) and part.isdigit() and int(part) < len(here):
            here = here[int(part)]
        else:
            return None
    return here


def _satisfiable(node: Any, root: Any, ok: set[int]) -> bool:
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True

    def known(sub: Any) -> bool:
        return not isinstance(sub, (dict, bool)) or id(sub) in ok

    if "$ref" in node and (target := _target(node, root)) is not None and not known(target):
        return False
    if isinstance(node.get("allOf"), list) and not all(known(s) for s in node["allOf"]):
        return False
    for word in ("anyOf", "oneOf"):
        if isinstance(node.get(word), list) and node[word] and not any(known(s) for s in node[word]):
            return False
    if node.get("type") == "object" and isinstance(node.get("required"), list):
        props: dict[str, Any] = node["properties"] if isinstance(node.get("properties"), dict) else {}
        if not all(known(props[name]) for name in node["required"] if isinstance(name, str) and name in props):
            return False
    if node.get("type") == "array" and isinstance(node.get("minItems"), int) and node["minItems"] > 0:
        prefix: list[Any] = node["prefixItems"] if isinstance(node.get("prefixItems"), list) else []
        needed = prefix[:node["minItems"]]
        if node["minItems"] > len(prefix) and "items" in node:
            needed = [*needed, node["items"]]
        if not all(known(s) for s in needed):
            return False
    return True
