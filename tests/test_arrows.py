"""The package arrows of the design, checked by reading every import.

    daemon     -> sessions, cachestore, protocol, common
    tui        -> protocol, common
    sessions   -> common
    cachestore -> common
    protocol   -> common
    common     -> no other kvd package

common/ is the one leaf every package may reach: the facts and helpers more
than one package needs (the durable write, the token-id blob codec, the
migration runner, ids, limits, tier names), stdlib-only.

Inside daemon/ the subpackages form a stack whose arrows all point down:

    cli > server > doors > turns > prompt > service > engine > models > device > config

(device.py decides every choice that depends on the device MLX runs on: the
engine, the model conversion and the BLAS probe below the service all ask it.)

Read from the source with `ast`, not from `sys.modules` after an import, so
an import inside a function, under `if TYPE_CHECKING:` or behind a branch
that a test never takes counts as much as one at the top of a module.
`importlib.import_module("...")` with a literal name counts too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED: dict[str, frozenset[str]] = {
    "daemon": frozenset({"sessions", "cachestore", "protocol", "common"}),
    "tui": frozenset({"protocol", "common"}),
    "sessions": frozenset({"common"}),
    "cachestore": frozenset({"common"}),
    "protocol": frozenset({"common"}),
    "common": frozenset(),
}
PACKAGES = frozenset(ALLOWED)
# daemon/'s stack, top to bottom: a module may import only from its own unit or one below it.
DAEMON_LAYERS = ("cli", "server", "doors", "turns", "feed", "turn", "transcripts", "renders", "prompt", "service",
                 "engine", "models", "device", "config", "events")


def imported(tree: ast.AST, module: str) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in `tree`, the module named `module`."""
    package = module.split(".")[:-1]  # "a.b.c" and "a.b.__init__" both live in package a.b
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            yield node.lineno, name
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            yield node.lineno, node.args[0].value


def wrong_arrows(root: Path) -> list[str]:
    """Each import under `root` that the design's arrows do not allow, as `file:line: a -> b`."""
    wrong = []
    for package, allowed in sorted(ALLOWED.items()):
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root)
            module = ".".join(relative.with_suffix("").parts)
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, name in imported(tree, module):
                target = name.split(".")[0]
                if target in PACKAGES and target != package and target not in allowed:
                    wrong.append(f"{relative}:{line}: {package} -> {target} ({name})")
    return wrong


def _daemon_unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "daemon" and len(parts) > 1 and parts[1] in DAEMON_LAYERS else None


def upward_arrows(root: Path) -> list[str]:
    """Each import inside daemon/ that runs up its stack, as `file:line: a -> b`."""
    wrong = []
    for path in sorted((root / "daemon").rglob("*.py")):
        relative = path.relative_to(root)
        module = ".".join(relative.with_suffix("").parts)
        source = _daemon_unit(module)
        if source is None:
            continue
        for line, name in imported(ast.parse(path.read_text(), filename=str(path)), module):
            target = _daemon_unit(name)
            if target is not None and DAEMON_LAYERS.index(target) < DAEMON_LAYERS.index(source):
                wrong.append(f"{relative}:{line}: {source} -> {target} ({name})")
    return wrong


def test_every_import_follows_the_arrows() -> None:
    assert all((ROOT / package / "__init__.py").is_file() for package in PACKAGES)
    assert wrong_arrows(ROOT) == []


def test_daemon_subpackages_form_a_stack() -> None:
    assert all((ROOT / "daemon" / unit).is_dir() or (ROOT / "daemon" / f"{unit}.py").is_file()
               for unit in DAEMON_LAYERS)
    assert unplaced(ROOT) == []  # (a unit outside the stack is never checked)
    assert upward_arrows(ROOT) == []


def unplaced(root: Path) -> list[str]:
    """daemon/'s modules and subpackages that DAEMON_LAYERS does not place."""
    units = {p.stem for p in (root / "daemon").glob("*.py") if p.stem != "__init__"}
    units |= {p.name for p in (root / "daemon").iterdir() if (p / "__init__.py").is_file()}
    return sorted(units - set(DAEMON_LAYERS))


def test_a_daemon_module_outside_the_stack_is_named(tmp_path: Path) -> None:
    (tmp_path / "daemon" / "engine").mkdir(parents=True)
    for path in ("daemon/__init__.py", "daemon/engine/__init__.py", "daemon/turns.py", "daemon/stray.py"):
        (tmp_path / path).write_text("")
    assert unplaced(tmp_path) == ["stray"]


def test_an_upward_arrow_is_found(tmp_path: Path) -> None:
    (tmp_path / "daemon" / "engine").mkdir(parents=True)
    (tmp_path / "daemon" / "engine" / "thread.py").write_text(
        "from ..config import Config\nfrom .jobs import Job\ndef f():\n    from ..doors.websocket import serve\n")
    assert [w.split(": ", 1)[1] for w in upward_arrows(tmp_path)] == ["engine -> doors (daemon.doors.websocket)"]


@pytest.mark.parametrize("source, found", [
    ("import daemon.engine.thread\n", "sessions -> daemon (daemon.engine.thread)"),
    ("def f():\n    from protocol import DEFAULT_TITLE\n", "sessions -> protocol (protocol)"),
    ("import common.durable\nimport protocol.wire\n", "sessions -> protocol (protocol.wire)"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cachestore.store import Checkout\n",
     "sessions -> cachestore (cachestore.store)"),
    ("import importlib\ndef f():\n    return importlib.import_module('tui.render')\n", "sessions -> tui (tui.render)"),
])  # fmt: skip
def test_a_wrong_arrow_is_found_wherever_the_import_is(tmp_path: Path, source: str, found: str) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "sessions" / "store.py").write_text("from . import ids\nfrom .ids import x\nimport json\n" + source)
    assert [w.split(": ", 1)[1] for w in wrong_arrows(tmp_path)] == [found]


def test_relative_imports_stay_in_their_package(tmp_path: Path) -> None:
    (tmp_path / "tui").mkdir()
    (tmp_path / "tui" / "__init__.py").write_text("")
    (tmp_path / "tui" / "deep").mkdir()
    (tmp_path / "tui" / "deep" / "mod.py").write_text("from .. import render\nfrom ..render import x\n")
    tree = ast.parse((tmp_path / "tui" / "deep" / "mod.py").read_text())
    assert [name for _, name in imported(tree, "tui.deep.mod")] == ["tui", "tui.render"]


def import_cycles(root: Path, package: str) -> list[list[str]]:
    """Each set of `package`'s modules that import one another in a ring (imports in functions count)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((root / package).rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        names = {name for _, name in imported(tree, module)}
        # `from . import commands` names the module tui.commands, not only the package tui
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = next(n for ln, n in imported(node, module))
                names |= {f"{base}.{alias.name}" for alias in node.names}
        graph[module.removesuffix(".__init__")] = names

    def known(name: str) -> str:
        while name and name not in graph:
            name = name.rpartition(".")[0]
        return name

    edges = {m: {known(n) for n in names if known(n) and known(n) != m} for m, names in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    rings: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            ring = []
            while True:
                w = stack.pop()
                ring.append(w)
                if w == v:
                    break
            if len(ring) > 1:
                rings.append(sorted(ring))

    for v in edges:
        if v not in index:
            visit(v)
    return rings


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycles_inside_a_package(package: str) -> None:
    assert import_cycles(ROOT, package) == []


def back_doors(root: Path, package: str, into: str) -> list[str]:
    """Each import in `package` of a module of `into` other than its front door (`into/__init__.py`)."""
    wrong = []
    for path in sorted((root / package).rglob("*.py")):
        relative = path.relative_to(root)
        module = ".".join(relative.with_suffix("").parts)
        for line, name in imported(ast.parse(path.read_text(), filename=str(path)), module):
            if name.split(".")[0] == into and name != into:
                wrong.append(f"{relative}:{line}: {name}")
    return wrong


def test_the_daemon_uses_cachestore_through_its_front_door() -> None:
    assert back_doors(ROOT, "daemon", "cachestore") == []


def test_a_back_door_is_found(tmp_path: Path) -> None:
    (tmp_path / "daemon" / "engine").mkdir(parents=True)
    (tmp_path / "daemon" / "engine" / "thread.py").write_text(
        "from cachestore import SessionCaches\ndef f():\n    from cachestore.snapshot import rewind\n")
    assert [w.split(": ", 1)[1] for w in back_doors(tmp_path, "daemon", "cachestore")] == ["cachestore.snapshot"]


def test_an_import_cycle_is_found(tmp_path: Path) -> None:
    (tmp_path / "tui").mkdir()
    (tmp_path / "tui" / "__init__.py").write_text("")
    (tmp_path / "tui" / "repl.py").write_text("from . import commands\n")
    (tmp_path / "tui" / "commands.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                  "    from .repl import Chat\n")
    assert import_cycles(tmp_path, "tui") == [["tui.commands", "tui.repl"]]


# --- the engine's door into the cache store: a handful of calls, each for what the engine needs (issue 52) ---

DOOR_MOST = 10


def store_members(root: Path) -> set[str]:
    """SessionCaches' public members: its methods and properties, and the attributes its methods set."""
    tree = ast.parse((root / "cachestore" / "store.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SessionCaches")
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
              if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return {n for n in names if not n.startswith("_")}


def _names_a_store(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "caches") or (isinstance(node, ast.Attribute)
                                                                     and node.attr == "caches")


def door_calls(root: Path) -> dict[str, list[str]]:
    """Each SessionCaches member the daemon reads off a cache store (`caches`, `self.caches`, `x.caches`), and where."""
    members, used = store_members(root), dict[str, list[str]]()
    for path in sorted((root / "daemon").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and _names_a_store(node.value) and node.attr in members:
                used.setdefault(node.attr, []).append(f"{path.relative_to(root)}:{node.lineno}")
    return used


def stores_by_other_names(root: Path) -> list[str]:
    """Where daemon/ holds a SessionCaches under another name than `caches` (door_calls would not see it)."""
    wrong = []
    for path in sorted((root / "daemon").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign):
                name, annotation = node.target, node.annotation
                named = name.id if isinstance(name, ast.Name) else name.attr if isinstance(name, ast.Attribute) else ""
            elif isinstance(node, ast.arg) and node.annotation is not None:
                named, annotation = node.arg, node.annotation
            else:
                continue
            if "SessionCaches" in ast.unparse(annotation) and named != "caches":
                wrong.append(f"{path.relative_to(root)}:{node.lineno}: {named}")
    return wrong


def test_the_engine_calls_at_most_ten_of_the_cache_stores_methods() -> None:
    """vLLM's scheduler needs about three calls on its cache manager; kvd's engine called 29 of SessionCaches'
    (the budget protocol and the I/O worker's manners among them). The door: store.py's class docstring."""
    used = door_calls(ROOT)
    assert len(used) <= DOOR_MOST, sorted(used)
    assert stores_by_other_names(ROOT) == []


def test_a_wider_door_is_counted(tmp_path: Path) -> None:
    (tmp_path / "cachestore").mkdir()
    (tmp_path / "daemon" / "engine").mkdir(parents=True)
    methods = [f"m{n}" for n in range(12)]
    (tmp_path / "cachestore" / "store.py").write_text(
        "class SessionCaches:\n    def __init__(self):\n        self.pool = None\n"
        + "".join(f"    def {m}(self):\n        pass\n" for m in methods))
    (tmp_path / "daemon" / "engine" / "thread.py").write_text(
        "def f(self, caches, store: 'SessionCaches'):\n"
        + "".join(f"    self.caches.{m}()\n" for m in methods[:9])
        + "    caches.m9()\n    caches.pop('x')\n    self.caches.pool.resize()\n    return store.m10()\n")
    assert sorted(door_calls(tmp_path)) == sorted([*methods[:10], "pool"])
    assert [w.split(": ")[1] for w in stores_by_other_names(tmp_path)] == ["store"]


# --- the doors ask the turn core (issue 52) ------------------------------------------------------

# Each reads its body through httpdoor.read_request.
HTTP_DOORS = ("openai_api", "anthropic_api", "responses", "ollama_api", "completions")


def reaches_past_the_turn_core(source: str) -> list[str]:
    """What a door module does that is the turn core's to do: write a `Turn`'s fields (`turn.x = …`,
    `turn.x += …`, `turn.x.append(…)`), or call the transcript writer (`….transcripts.writer`)."""
    found = []

    def is_turn(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id == "turn") or (
            isinstance(node, ast.Attribute) and node.attr == "turn")

    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        found += [f"line {t.lineno}: writes turn.{t.attr}" for t in targets
                  if isinstance(t, ast.Attribute) and is_turn(t.value)]
        if isinstance(node, ast.Call) and isinstance(f := node.func, ast.Attribute) and isinstance(
                f.value, ast.Attribute) and is_turn(f.value.value) and f.attr in ("append", "extend", "clear", "pop"):
            found.append(f"line {node.lineno}: changes turn.{f.value.attr}")
        if isinstance(node, ast.Attribute) and node.attr == "writer" and isinstance(
                node.value, ast.Attribute) and node.value.attr == "transcripts":
            found.append(f"line {node.lineno}: calls the transcript writer")
    return found


def test_no_door_writes_a_turn_or_calls_the_transcript_writer() -> None:
    found = {path.name: reached for path in sorted((ROOT / "daemon" / "doors").glob("*.py"))
             if (reached := reaches_past_the_turn_core(path.read_text()))}
    assert found == {}


def test_a_door_reaching_past_the_turn_core_is_found() -> None:
    source = ("def start(self, turn, row):\n    turn.writes.append(self.turns.transcripts.writer.submit(row))\n"
              "    turn.unstored = []\n")
    assert reaches_past_the_turn_core(source) == [
        "line 3: writes turn.unstored", "line 2: changes turn.writes", "line 2: calls the transcript writer"]


def _calls(path: Path) -> set[str]:
    return {node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Name, ast.Attribute))}


def test_every_http_door_reads_its_body_one_way_and_refuses_with_one_error_type() -> None:
    doors = ROOT / "daemon" / "doors"
    for name in HTTP_DOORS:
        calls = _calls(doors / f"{name}.py")
        assert "read_request" in calls and not calls & {"read_body", "decode_json", "with_traceback"}, name
    readers = {path.name for path in doors.glob("*.py") if _calls(path) & {"read_body", "decode_json"}}
    assert readers <= {"httpdoor.py"}, readers
    errors = {f"{path.name}: {node.name}" for path in doors.glob("*.py")
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.ClassDef) and node.name.endswith("Error")}
    assert errors == {"httpdoor.py: ApiError"}, errors
