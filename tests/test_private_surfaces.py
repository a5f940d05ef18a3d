"""kvd reaches mlx, mlx-lm, uvicorn and starlette through their public surfaces only, checked by reading the code.

Their private names are read from their installed sources with `ast`: every
`_name` (one leading underscore, not a dunder) they define as a function,
class, module or class variable, or assign as an attribute (`self._x = ...`),
plus the underscore names of `mlx.core` (a compiled module). Then every kvd
module is read: an attribute `x._name` (read, written or called) or an
`import` of `_name` from one of those packages fails with its module, line
and name, when `_name` is one of theirs, unless

- `x` is `self` or `cls` in a kvd class that defines `_name` itself (its own
  state, whatever other packages call theirs), or
- the (module, name) pair is listed in EXCEPTIONS below with its reason.

Kept on purpose, and not underscore attributes (so not in the list): the
OpenAI door's `doors/h11guard.py` subclasses uvicorn's `H11Protocol` (given
to uvicorn through its public `http=` option) for the request-head deadline
uvicorn lacks, overriding only asyncio's public protocol methods; and
`server.py` overrides `Server.capture_signals` (a public method) so that
kvd's own signal handling stays in charge. Both are pinned by the version
ceiling on uvicorn in pyproject.toml.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KVD = ("daemon", "cachestore", "sessions", "tui", "protocol", "common")
THEIRS = ("mlx", "mlx_lm", "uvicorn", "starlette")

# (kvd module, attribute): why it stays. Each entry must still be needed (see the last test).
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("daemon.engine.grammar", "_tokenizer"):
        "mlx-lm's TokenizerWrapper holds the Hugging Face tokenizer only as `_tokenizer` (its "
        "__getattr__ forwards attributes, not the object); llguidance's from_tokenizer needs the object",
    ("cachestore.kinds", "_temporal_order"):
        "a sliding-window layer's snapshot reads RotatingKVCache's ring in temporal order; "
        "mlx-lm 0.32 and its main branch expose the ring's write index through different "
        "state layouts (state vs meta_state), and neither has a public temporal read",
    ("daemon.models.catalog", "_get_classes"):
        "mlx-lm has no public 'which architectures can you load' call; `_get_classes` is the lookup "
        "its own `load_model` does (remappings included), so `kvd models` says what loading will do",
    ("daemon.models.sources", "_get_classes"):
        "the same check, before a model directory is accepted (a clear error instead of a failed load)",
    ("daemon.models.sources", "_download"):
        "mlx-lm's fetch of a Hugging Face repo with the file patterns its loader needs; `mlx_lm.load` "
        "does the same internally but also loads the weights, which `kvd serve` does later on its thread",
    ("cachestore.kinds", "_idx"):
        "restoring a RotatingKVCache sets its write index (same reason as _temporal_order)",
}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, name
    return Path(next(iter(spec.submodule_search_locations)))


def their_private_names() -> frozenset[str]:
    names: set[str] = set()
    for package in THEIRS:
        for path in package_dir(package).rglob("*.py"):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
    import mlx.core as mx

    names.update(dir(mx))
    return frozenset(n for n in names if private(n))


def modules() -> Iterator[tuple[str, ast.Module]]:
    for package in KVD:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            yield ".".join(rel.parts), ast.parse(path.read_text(encoding="utf-8"))


def own_names(cls: ast.ClassDef) -> set[str]:
    """The names a kvd class defines itself: its methods, class variables, and `self.x = ...`."""
    out: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in cls.body:
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            out.add(node.attr)
        elif isinstance(node, (ast.AnnAssign, ast.Assign)) and node in cls.body:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def reaches(tree: ast.Module, theirs: frozenset[str]) -> Iterator[tuple[int, str]]:
    """(line, name) of each reach into a private name of theirs in one kvd module."""
    owned: dict[int, set[str]] = {}  # id(attribute node) -> names its enclosing class owns
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            mine = own_names(cls)
            for node in ast.walk(cls):
                owned.setdefault(id(node), set()).update(mine)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in THEIRS:
            for alias in node.names:
                if private(alias.name):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.Attribute) and private(node.attr) and node.attr in theirs:
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if on_self and node.attr in owned.get(id(node), set()):
                continue
            yield node.lineno, node.attr


def found() -> dict[tuple[str, str], list[int]]:
    theirs = their_private_names()
    out: dict[tuple[str, str], list[int]] = {}
    for module, tree in modules():
        for line, name in reaches(tree, theirs):
            out.setdefault((module, name), []).append(line)
    return out


def test_no_kvd_module_touches_their_private_names() -> None:
    bad = {k: v for k, v in found().items() if k not in EXCEPTIONS}
    assert not bad, "kvd reaches private names of mlx / mlx-lm / uvicorn / starlette:\n" + "\n".join(
        f"  {module}:{lines} .{name}" for (module, name), lines in sorted(bad.items()))


def test_every_exception_is_still_needed() -> None:
    stale = set(EXCEPTIONS) - set(found())
    assert not stale, f"listed but no longer used (remove them): {sorted(stale)}"


def test_the_check_can_fail() -> None:
    """The check sees a write, a read, a call and an import of their private names, and not kvd's own."""
    theirs = frozenset({"_idx", "_temporal_order", "_BaseCache", "_next_tokens"})
    tree = ast.parse(
        "from mlx_lm.models.cache import _BaseCache\n"
        "def f(batch, c):\n"
        "    batch._next_tokens = 1\n"
        "    c._temporal_order(c._idx)\n"
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self._idx = 0\n"
        "    def g(self, other):\n"
        "        return self._idx + other.keys\n")
    assert sorted(reaches(tree, theirs)) == [(1, "_BaseCache"), (3, "_next_tokens"), (4, "_idx"),
                                            (4, "_temporal_order")]
