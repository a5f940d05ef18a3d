"""No function in the packages above McCabe complexity 15 (ruff's C901, in `make check`), except where a
`# noqa: C901` says why."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "protocol", "sessions", "cachestore", "common", "tui")
BRANCHES = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(16))


def ruff(root: Path, *paths: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--config", str(ROOT / "pyproject.toml"),
                           "--select", "C901", *paths], cwd=root, capture_output=True, text=True, timeout=120)


def test_a_function_over_15_fails_the_check(tmp_path: Path) -> None:
    (tmp_path / "daemon").mkdir()
    (tmp_path / "daemon" / "x.py").write_text(f"def f(x: int) -> int:\n{BRANCHES}    return -1\n")
    result = ruff(tmp_path, "daemon")
    assert result.returncode == 1 and "C901 `f` is too complex (17 > 15)" in result.stdout, result.stdout
    (tmp_path / "daemon" / "x.py").write_text(f"def f(x: int) -> int:  # noqa: C901 - a table\n{BRANCHES}"
                                              "    return -1\n")
    assert ruff(tmp_path, "daemon").returncode == 0


def test_the_packages_pass_and_every_exception_says_why() -> None:
    assert ruff(ROOT, *PACKAGES).returncode == 0
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if "noqa: C901" in line:
                    reason = line.split("noqa: C901", 1)[1]
                    following = path.read_text().splitlines()[n].strip()
                    assert re.search(r"\w{3,}", reason) or following.startswith("#"), f"{path}:{n}: say why"


# Modules over MODULE_LINES, each with why it is not split (yet). A module that grows past the
# bound fails the test below until it is split along a real seam or argued for here.
MODULE_LINES = 450
LONG_MODULES = {
    "daemon/turns.py": "the turn core: one class whose methods share one session bookkeeping (send, regenerate, "
                       "edit and apply; the fed-token rule; the pump and its commits). What one turn is went to "
                       "turn.py; cutting the pump from the rules it commits would make the mixin STYLE.md rejects",
    "cachestore/direct.py": "one data path (scan, allocate, fill, finish) over one private buffer layout "
                            "(slots, offsets, capacity); a split would make that layout public to two modules",
    "daemon/models/gguf.py": "one converter: the format checks, gguf-py's and MLX's readers, the tokenizer "
                             "hand-off; its docstring (35 lines of measured facts) is what keeps it honest",
}


def long_modules(root: Path) -> dict[str, int]:
    """Each module of the packages longer than MODULE_LINES lines, by its path under `root`."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if (n := len(path.read_text().splitlines())) > MODULE_LINES:
                found[path.relative_to(root).as_posix()] = n
    return found


def test_no_module_is_long_without_a_reason() -> None:
    assert sorted(long_modules(ROOT)) == sorted(LONG_MODULES)


def test_a_long_module_is_found(tmp_path: Path) -> None:
    (tmp_path / "cachestore").mkdir()
    (tmp_path / "cachestore" / "store.py").write_text("x = 1\n" * (MODULE_LINES + 1))
    (tmp_path / "cachestore" / "short.py").write_text("x = 1\n" * MODULE_LINES)
    assert long_modules(tmp_path) == {"cachestore/store.py": MODULE_LINES + 1}
