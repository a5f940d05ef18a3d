"""Docs that work when pasted: every runnable code block in README.md and docs/*.md, run against a real `kvd serve`.

The convention (invisible to a reader pasting a block):
a fenced block whose info string is `python test` or `sh test` is run here.
GitHub and every Markdown renderer read only the info string's first word, so
the block still renders as Python or shell. Every `python` block and every
block that calls `curl` must carry the marker (an API example nobody runs is
how the docs came to send a model name the server refused); other shell
blocks (installs, benchmarks, `kvd logs -f`) opt in when they can run here.

A block runs as a user would paste it, with two substitutions the docs
themselves imply: HOME is a fresh directory whose `~/.local/share/kvd` is the
daemon's data directory (so `~/.local/share/kvd/token` and kvchat's discovery
are the real ones), and `127.0.0.1:8765`, the default address, becomes the
test daemon's (it listens on port 0). `kvd` and `kvchat` are this checkout's,
on PATH and as `.venv/bin/` in the working directory, which is a small git
repository with one uncommitted change (for `git diff | kvchat -`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from daemonproc import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "test"
DEFAULT_ADDRESS = "127.0.0.1:8765"
RUN_TIMEOUT = 120.0
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    language: str
    marked: bool
    body: str

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            words = m.group("info").split()
            if not words:
                continue
            body = "".join(line[len(m.group("indent")):] if line.startswith(m.group("indent")) else line
                           for line in m.group("body").splitlines(keepends=True))
            found.append(Block(doc, text.count("\n", 0, m.start()) + 1, words[0], MARKER in words[1:], body))
    return found


RUNNABLE = [b for b in blocks() if b.marked]


def test_every_api_example_is_marked_runnable() -> None:
    """A Python or curl example left unmarked would never run: this fails until it carries `test`."""
    unmarked = [b.name for b in blocks() if not b.marked
                and (b.language == "python" or (b.language in ("sh", "bash") and "curl " in b.body))]
    assert not unmarked, f"mark these blocks ```{{language}} {MARKER} so tests/test_docs_run.py runs them: {unmarked}"
    assert {b.language for b in RUNNABLE} >= {"python", "sh"}
    assert all(b.language in ("python", "sh") for b in RUNNABLE), [b.name for b in RUNNABLE]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, DaemonProcess]]:
    home = tmp_path_factory.mktemp("home")
    (home / ".venv").symlink_to(Path(sys.executable).parent.parent)
    git = ["git", "-c", "user.name=kvd", "-c", "user.email=kvd@localhost"]
    subprocess.run([*git, "init", "-q"], cwd=home, check=True)
    (home / "notes.txt").write_text("one\n")
    subprocess.run([*git, "add", "notes.txt"], cwd=home, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "notes"], cwd=home, check=True)
    (home / "notes.txt").write_text("one\ntwo\n")
    (home / ".local/share").mkdir(parents=True)
    d = DaemonProcess(home / ".local/share/kvd")
    with d.client():
        pass  # the model has loaded
    yield home, d
    assert d.terminate() == 0


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.name)
def test_block_runs(block: Block, home: tuple[Path, DaemonProcess]) -> None:
    home_dir, d = home
    address = d.base_url.removeprefix("http://").removesuffix("/v1")
    body = block.body.replace(DEFAULT_ADDRESS, address)
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env.update(HOME=str(home_dir), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-c", body] if block.language == "python" else ["bash", "-e", "-c", body]
    done = subprocess.run(argv, cwd=home_dir, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{block.name} failed ({done.returncode}):\n{body}\n--- stdout\n{done.stdout}" \
                                 f"\n--- stderr\n{done.stderr}"
    assert done.stdout.strip(), f"{block.name} printed nothing"


@pytest.mark.parametrize("name", ["kvd", "builtin:tiny", "tiny"])
def test_model_names_a_local_server_accepts(name: str, home: tuple[Path, DaemonProcess]) -> None:
    _, d = home
    client = openai.OpenAI(base_url=d.base_url, api_key=d.token, max_retries=0)
    got = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert got.model == "builtin:tiny"
    assert client.models.retrieve(name).id == "builtin:tiny"


def test_an_unknown_model_is_a_404_naming_the_served_one(home: tuple[Path, DaemonProcess]) -> None:
    _, d = home
    client = openai.OpenAI(base_url=d.base_url, api_key=d.token, max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": "hi"}])
    assert "'builtin:tiny'" in str(caught.value) and "'kvd'" in str(caught.value)
