"""One name per thing (issue 52): no two kvd classes share a public name, and the glossary of
docs/architecture.md is the code's: each `Name` it places in a `file.py` is there, and no class is called
a word a glossary line says not to use (`(not: `Word`, ...)`).

Read from the source with `ast`, as tests/test_arrows.py reads imports: a class counts whether or not
anything imports its module.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "sessions", "cachestore", "tui", "protocol", "common")

# `Name` (`file.py`) and `Name`, `file.py`; or `file.py`, `name`
NAME_THEN_PATH = re.compile(r"`(?P<name>[A-Za-z_][\w.]*)`,? \(?`(?P<path>[\w/]+\.py)`")
PATH_THEN_NAME = re.compile(r"`(?P<path>[\w/]+\.py)`, `(?P<name>[A-Za-z_][\w.]*)`")
NOT = re.compile(r"(?:\(|; )not: (?P<words>`\w+`(?:, `\w+`)*)\)")


def classes() -> dict[str, list[str]]:
    """Every module-level public class of the packages: name -> the modules defining one."""
    found: dict[str, list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.parse(path.read_text(), str(path)).body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    found[node.name].append(str(path.relative_to(ROOT)))
    return found


def glossary() -> list[str]:
    """The glossary's entries, each joined onto one line."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Glossary\n", 1)[1].split("\n## ", 1)[0]
    entries: list[str] = []
    for line in section.splitlines():
        if line.startswith("- "):
            entries.append(line[2:])
        elif line.startswith("  ") and entries:
            entries[-1] += " " + line.strip()
    return entries


def _defines(tree: ast.Module, dotted: str) -> bool:
    """A module-level class, function or assignment of that name; `Class.attr`: a method or field of it."""
    first, _, attr = dotted.partition(".")
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == first:
            if not attr:
                return True
            return isinstance(node, ast.ClassDef) and any(
                (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == attr)
                or (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == attr)
                for n in node.body)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if not attr and any(isinstance(t, ast.Name) and t.id == first for t in targets):
            return True
    return False


def test_no_two_classes_share_a_name() -> None:
    shared = {name: where for name, where in classes().items() if len(where) > 1}
    assert not shared, "one name per thing: these classes share a name (rename all but the glossary's): " + \
        "; ".join(f"{name} in {', '.join(where)}" for name, where in sorted(shared.items()))


def test_the_glossary_names_what_the_code_has() -> None:
    placed = [(m["name"], m["path"]) for entry in glossary()
              for pattern in (NAME_THEN_PATH, PATH_THEN_NAME) for m in pattern.finditer(entry)]
    assert len(placed) >= 20, placed  # the glossary's own form, read: a reader that matches nothing proves nothing
    wrong = []
    for name, path in placed:
        file = ROOT / path
        if not file.is_file():
            wrong.append(f"`{name}`: no file {path}")
        elif not _defines(ast.parse(file.read_text()), name):
            wrong.append(f"`{name}` is not in {path}")
    assert not wrong, "docs/architecture.md's glossary: " + "; ".join(wrong)


def test_no_class_is_called_a_word_the_glossary_refuses() -> None:
    refused = {w.strip("`") for entry in glossary() for m in NOT.finditer(entry) for w in m["words"].split(", ")}
    assert refused, "the glossary says no word not to use: NOT does not read it"
    have = classes()
    used = {w: have[w] for w in sorted(refused) if w in have}
    assert not used, "the glossary says not to call a class these: " + \
        "; ".join(f"{w} ({', '.join(where)})" for w, where in used.items())
