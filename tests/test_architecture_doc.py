"""docs/architecture.md kept true by reading the code: its map and its walk.

- The map ("The packages and their arrows"): every module of every package has its line, `- `file.py`: its
  role`, under its package's heading (`### daemon/doors/`), and every module listed there exists. A failure
  names each module missing and each listed one that is gone, so a branch that adds modules knows which
  lines to write.
- The walk ("Three flows"): each numbered step names files and functions (`daemon/turns.py` `Turns.send`,
  then `_submit`, `Engine.tokenize`, ...); each must exist, read from the source with `ast`. Anywhere in
  the document, a file named must exist, a file followed by a name must define that name, and a
  `Class.attribute` of a kvd class must be one of that class's. The step and module counts stated under
  the walk are the walk's own.
- The long modules: each module `tests/test_complexity.py` allows over its cap is argued for in the
  document's "Long modules"; each other module of CAP_NEAR lines or more is in its "At the cap" list, with
  its length as it is.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from test_complexity import LONG_MODULES, MODULE_LINES

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("common", "protocol", "sessions", "cachestore", "daemon", "tui")
MAP = "The packages and their arrows"
FLOWS = "Three flows"
LINE = re.compile(r"- `(?P<file>\w+\.py)`: (?P<role>\S.*)")
HEADING = re.compile(r"### (?P<package>[\w/]+)/")
SPAN = re.compile(r"`([^`\n]+)`")
NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
STEP = re.compile(r"(\d+)\. (.*)")
# The walk's backticked words that are not kvd's Python names.
CAP_NEAR = 430  # "At the cap (430 lines or more)": the modules a next change may have to split
AT_CAP = re.compile(r"- `(?P<path>[\w/]+\.py)` \((?P<lines>\d+)\):")
NOT_CODE = frozenset({"chat.send", "chat.start", "chat.delta", "chat.done", "chat.progress", "session.get",
                      "call_soon_threadsafe"})  # the wire's frame names; asyncio's


def section(text: str, title: str) -> str:
    """The text under `## title`, up to the next `## ` heading."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def package_modules(root: Path) -> set[str]:
    """Every module of every package, as its path under `root` (`daemon/doors/websocket.py`)."""
    return {path.relative_to(root).as_posix() for package in PACKAGES for path in (root / package).rglob("*.py")}


def read_map(text: str) -> tuple[dict[str, str], list[str]]:
    """The map's modules ({path: role}) and what in it cannot be read as one module's line."""
    listed: dict[str, str] = {}
    unreadable: list[str] = []
    package = None
    for line in section(text, MAP).splitlines():
        if line.startswith("### "):
            heading = HEADING.fullmatch(line)
            package = heading["package"] if heading and heading["package"].split("/")[0] in PACKAGES else None
        elif package and line.startswith("- "):
            if (m := LINE.fullmatch(line)) is None:
                unreadable.append(f"under ### {package}/, not `- `file.py`: its role`: {line}")
            elif (path := f"{package}/{m['file']}") in listed:
                unreadable.append(f"listed twice: {path}")
            else:
                listed[path] = m["role"]
    return listed, unreadable


def map_problems(root: Path, text: str) -> list[str]:
    """What the map says that the packages do not, one line each."""
    listed, problems = read_map(text)
    modules = package_modules(root)
    for path in sorted(modules - set(listed)):
        package, file = path.rsplit("/", 1)
        problems.append(f"missing from the map: {path} (add `- `{file}`: its role` under ### {package}/)")
    problems += [f"in the map but not a module: {path}" for path in sorted(set(listed) - modules)]
    return problems


@dataclass
class Code:
    """What the packages define, by name: enough to say whether the document names something real."""

    modules: set[str]
    top: dict[str, set[str]] = field(default_factory=dict)  # module path -> its top-level names
    anywhere: dict[str, set[str]] = field(default_factory=dict)  # module path -> every def and class in it
    classes: dict[str, list[tuple[set[str], list[str]]]] = field(default_factory=lambda: defaultdict(list))
    stems: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # `prefill` -> its paths

    def attribute(self, cls: str, name: str, seen: frozenset[str] = frozenset()) -> bool:
        """Whether some kvd class called `cls` (or a kvd class it derives from) has `name`."""
        return any(name in attributes or any(self.attribute(base, name, seen | {cls})
                                             for base in bases if base not in seen | {cls})
                   for attributes, bases in self.classes.get(cls, []))

    def defines(self, path: str, name: str) -> bool:
        """Whether module `path` defines `name` (`f`, `Class`, `Class.method`) at its top level."""
        head, _, rest = name.partition(".")
        if head not in self.top.get(path, set()):
            return False
        return not rest or ("." not in rest and self.attribute(head, rest))

    def resolves(self, name: str, here: str | None) -> bool:
        """Whether a name the walk uses is kvd's: in the current module, or a class's, module's or package's."""
        if here is not None and (self.defines(here, name) or name in self.anywhere[here]):
            return True
        head, _, rest = name.partition(".")
        if not rest:
            return any(name in names for names in self.top.values())
        if "." not in rest and self.attribute(head, rest):
            return True
        return any(self.defines(path, rest) for path in self.stems.get(head, ()))


def _class_attributes(node: ast.ClassDef) -> set[str]:
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
        elif isinstance(item, ast.Assign):
            names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
            sub, (ast.AnnAssign, ast.AugAssign)) else []
        names |= {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                  and t.value.id == "self"}
    return names


def read_code(root: Path) -> Code:
    code = Code(package_modules(root))
    for path in sorted(code.modules):
        tree = ast.parse((root / path).read_text(), filename=path)
        top = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, ast.Assign):
                top |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                top.add(node.target.id)
        code.top[path] = top
        code.anywhere[path] = {n.name for n in ast.walk(tree)
                               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr for b in n.bases
                         if isinstance(b, (ast.Name, ast.Attribute))]
                code.classes[n.name].append((_class_attributes(n), bases))
        stem = Path(path).stem if Path(path).stem != "__init__" else Path(path).parent.name
        code.stems[stem].add(path)
    return code


def _file(root: Path, code: Code, span: str) -> tuple[str | None, str | None]:
    """(the kvd module a `*.py` span names, or None; what is wrong with it, or None)."""
    if "/" not in span:
        paths = [p for p in code.modules if p.rsplit("/", 1)[-1] == span]
        return (paths[0] if len(paths) == 1 else None), (None if paths else f"`{span}`: no module of that name")
    if not (root / span).is_file():
        return None, f"`{span}`: no such file"
    return (span if span in code.modules else None), None


def reference_problems(root: Path, text: str) -> list[str]:
    """Each file, file + name, or `Class.attribute` the document names that the code does not have."""
    code = read_code(root)
    problems: list[str] = []
    flows = section(text, FLOWS)
    steps = [m for line in flows.splitlines() if (m := STEP.fullmatch(line))]
    # The steps are read below, with their stricter rule; the map's lines are the map test's.
    rest = "\n".join(line for line in text.replace(flows, "\n".join(
        line for line in flows.splitlines() if not STEP.fullmatch(line))).splitlines() if not LINE.fullmatch(line))
    for where, body, strict in [("", rest, False)] + [(f"step {m[1]}: ", m[2], True) for m in steps]:
        here = cls = None
        previous_end = -1
        for m in SPAN.finditer(body):
            span = m[1].strip().removesuffix("()")
            adjacent = here is not None and previous_end >= 0 and body[previous_end:m.start()].strip() == ""
            previous_end = -1
            file, _, name = span.partition(":") if span.count(":") == 1 and ".py:" in span else (span, "", "")
            if file.endswith(".py"):
                here, wrong = _file(root, code, file)
                previous_end = m.end()
                if wrong:
                    problems.append(where + wrong)
                elif name and here and not code.defines(here, name):
                    problems.append(f"{where}`{span}`: {here} defines no {name}")
                continue
            if not NAME.fullmatch(span) or span in NOT_CODE:
                continue
            if adjacent and here is not None:
                cls = span.split(".")[0] if "." in span else cls
                if not code.defines(here, span):
                    problems.append(f"{where}`{span}`: {here} has no {span}")
            elif strict:
                if cls is not None and "." not in span and code.attribute(cls, span):
                    continue
                if "." in span:
                    cls = span.split(".")[0]
                if not code.resolves(span, here):
                    problems.append(f"{where}`{span}`: not a name in {here or 'the step'} nor of a kvd class or module")
            elif "." in span and span.count(".") == 1 and span.split(".")[0] in code.classes:
                if not code.attribute(*span.split(".")):
                    problems.append(f"{where}`{span}`: no kvd class {span.split('.')[0]} has {span.split('.')[1]}")
    return list(dict.fromkeys(problems))


def count_problems(root: Path, text: str) -> list[str]:
    """The walk's own counts, as the sentence under it states them: its steps and the modules they name."""
    flows = section(text, FLOWS)
    steps = [m[2] for line in flows.splitlines() if (m := STEP.fullmatch(line))]
    code = read_code(root)
    named = {f for step in steps for span in SPAN.findall(step)
             if span.endswith(".py") and (f := _file(root, code, span)[0])}
    stated = re.search(r"\n(\d+) steps, in (\d+) modules", flows)
    if stated is None:
        return ["the walk's sentence `N steps, in M modules` is gone"]
    problems = []
    if int(stated[1]) != len(steps):
        problems.append(f"the walk says {stated[1]} steps; it has {len(steps)}")
    if int(stated[2]) != len(named):
        problems.append(f"the walk says {stated[2]} modules; its steps name {len(named)}: {', '.join(sorted(named))}")
    return problems


def test_the_map_lists_every_module_and_no_other() -> None:
    problems = map_problems(ROOT, DOC.read_text())
    assert not problems, "docs/architecture.md's map:\n" + "\n".join(problems)


def test_every_role_is_said() -> None:
    listed, _ = read_map(DOC.read_text())
    assert set(listed) == package_modules(ROOT)
    assert [path for path, role in listed.items() if len(role.split()) < 2] == []


def test_the_walk_names_code_that_exists() -> None:
    text = DOC.read_text()
    problems = reference_problems(ROOT, text) + count_problems(ROOT, text)
    assert not problems, "docs/architecture.md names what the code lacks:\n" + "\n".join(problems)


def test_every_long_module_is_argued_for() -> None:
    long = section(DOC.read_text(), MAP).split("### Long modules", 1)[1]
    assert [path for path in LONG_MODULES if f"- `{path}`:" not in long] == []


def cap_problems(root: Path, text: str) -> list[str]:
    """What the "At the cap" list says wrong: a length that is not the module's, a module near the cap that
    it leaves out, one that is no longer near it."""
    long = section(text, MAP).split("### Long modules", 1)[1]
    stated = {m["path"]: int(m["lines"]) for m in AT_CAP.finditer(long)}
    lines = {path: len((root / path).read_text().splitlines()) for path in package_modules(root)}
    problems = [f"{path}: the list says {n} lines; it has {lines[path]}" if path in lines
                else f"{path}: listed at the cap, but not a module"
                for path, n in stated.items() if lines.get(path) != n]
    problems += [f"{path}: {lines[path]} lines, under the cap's {CAP_NEAR}: drop it from the list"
                 for path in stated if path in lines and lines[path] < CAP_NEAR]
    problems += [f"{path} ({n}): {CAP_NEAR} lines or more and not in the list (add `- `{path}` ({n}): ...`)"
                 for path, n in sorted(lines.items())
                 if CAP_NEAR <= n <= MODULE_LINES and path not in stated and path not in LONG_MODULES]
    return problems


def test_the_modules_at_the_cap_are_listed_with_their_lengths() -> None:
    problems = cap_problems(ROOT, DOC.read_text())
    assert not problems, "docs/architecture.md's \"At the cap\" list:\n" + "\n".join(problems)


DOC_FIXTURE = """# x

## The packages and their arrows

### daemon/

- `__init__.py`: the package
- `gone.py`: a module that went

### Long modules

- `daemon/kept.py`: not a map line

At the cap:

- `daemon/walk.py` (12): stale

## Three flows

1. `daemon/walk.py` `Walker.step` → `helper` → `Walker.gone`: the step.
2. `daemon/walk.py` `missing`, then `daemon/nowhere.py`.

2 steps, in 1 modules.
"""


def _fixture(tmp_path: Path) -> str:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "daemon" / "walk.py").write_text(
        "class Walker:\n    def step(self) -> None:\n        def helper() -> None: ...\n")
    (tmp_path / "daemon" / "kept.py").write_text("")
    return DOC_FIXTURE


def test_a_missing_or_gone_module_is_named(tmp_path: Path) -> None:
    text = _fixture(tmp_path)
    problems = map_problems(tmp_path, text)
    assert "missing from the map: daemon/walk.py (add `- `walk.py`: its role` under ### daemon/)" in problems
    assert "missing from the map: common/__init__.py (add `- `__init__.py`: its role` under ### common/)" in problems
    assert "in the map but not a module: daemon/gone.py" in problems
    assert set(read_map(text)[0]) == {"daemon/__init__.py", "daemon/gone.py"}  # not "Long modules"' lines
    assert read_map(text.replace("- `gone.py`: a module that went", "- `gone.py`:"))[1] == [
        "under ### daemon/, not `- `file.py`: its role`: - `gone.py`:"]


def test_a_walk_naming_what_is_not_there_fails(tmp_path: Path) -> None:
    problems = reference_problems(tmp_path, _fixture(tmp_path))
    assert problems == [
        "step 1: `Walker.gone`: not a name in daemon/walk.py nor of a kvd class or module",
        "step 2: `missing`: daemon/walk.py has no missing",
        "step 2: `daemon/nowhere.py`: no such file",
    ]
    assert count_problems(tmp_path, DOC_FIXTURE) == []
    assert count_problems(tmp_path, DOC_FIXTURE.replace("2 steps", "3 steps")) == [
        "the walk says 3 steps; it has 2"]


def test_a_stale_length_and_an_unlisted_module_at_the_cap_are_named(tmp_path: Path) -> None:
    text = _fixture(tmp_path)
    (tmp_path / "daemon" / "big.py").write_text("x = 1\n" * CAP_NEAR)
    assert cap_problems(tmp_path, text) == [
        "daemon/walk.py: the list says 12 lines; it has 3",
        "daemon/walk.py: 3 lines, under the cap's 430: drop it from the list",
        "daemon/big.py (430): 430 lines or more and not in the list (add `- `daemon/big.py` (430): ...`)"]
