"""A real `kvd serve` on a data dir that is wrong: one line saying what to do, a non-zero exit.

Permission failures need permission checks: as root (CI, containers) the
daemon runs without the capabilities that bypass file modes. Also: everything kvd creates is owner-only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from daemonproc import DaemonProcess

TIMEOUT = 120
DROP = "-dac_override,-dac_read_search"


def checked() -> list[str]:
    """A command prefix under which the kernel's permission checks apply to us.

    Root bypasses file modes; root without CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH (util-linux's setpriv) does not.
    """
    if os.getuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv (util-linux): file modes cannot be tested")
    return [setpriv, f"--inh-caps={DROP}", f"--bounding-set={DROP}"]


def serve(d: Path, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*(prefix or []), sys.executable, "-m", "daemon.cli", "serve", "--model",
                           "builtin:tiny", "--port", "0", "--data-dir", str(d)],
                          capture_output=True, text=True, timeout=TIMEOUT)


def one_error(out: subprocess.CompletedProcess[str]) -> str:
    """The run failed with exactly one error line, no traceback, and never listened."""
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "listening" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("kvd: error:")]
    assert len(errors) == 1, out.stderr
    return errors[0]


def make_data_dir(d: Path) -> None:
    """A data dir as a clean stop leaves it: token, database, a cache segment."""
    proc = DaemonProcess(d)
    with proc.client() as c:
        sid = c.request("session.create")["session"]["id"]
        c.chat(sid, "hello", max_tokens=3, temperature=0)
    assert proc.terminate() == 0, "".join(proc.log)


def test_malformed_database(tmp_path: Path) -> None:
    d = tmp_path / "data"
    d.mkdir(mode=0o700)
    (d / "kvd.sqlite").write_bytes(b"this is not a database\n" * 400)
    line = one_error(serve(d))
    assert line.startswith(f"kvd: error: {d / 'kvd.sqlite'} is not a kvd database or is damaged "
                           "(file is not a database); there is no backup in")
    assert "move kvd.sqlite aside to start with no sessions" in line


def test_damaged_database_points_at_the_newest_backup(tmp_path: Path) -> None:
    d = tmp_path / "data"
    make_data_dir(d)
    backups = sorted((d / "backups").iterdir())
    assert backups  # the clean stop wrote one
    with open(d / "kvd.sqlite", "r+b") as f:  # the header survives, the schema page does not
        f.seek(100)
        f.write(b"\xff" * 3000)
    line = one_error(serve(d))
    assert f"restore the newest backup: cp {backups[-1]} {d / 'kvd.sqlite'}" in line
    # Following the line works: the session is back.
    db = d / "kvd.sqlite"
    shutil.copy(backups[-1], db)
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    assert sqlite3.connect(db).execute("SELECT count(*) FROM sessions").fetchone() == (1,)


@pytest.mark.parametrize("name, what", [
    ("kvd.sqlite", "cannot open the transcript database"),
    ("kvd.sqlite-wal", "cannot open the transcript's write-ahead log"),
    ("token", "cannot read the token file"),
])
def test_unreadable_file(tmp_path: Path, name: str, what: str) -> None:
    d = tmp_path / "data"
    make_data_dir(d)
    (d / name).touch()
    (d / name).chmod(0)
    line = one_error(serve(d, checked()))
    assert line.startswith(f"kvd: error: {what} {d / name}: Permission denied")


def test_read_only_data_dir(tmp_path: Path) -> None:
    d = tmp_path / "data"
    make_data_dir(d)
    d.chmod(0o500)
    try:
        line = one_error(serve(d, checked()))
    finally:
        d.chmod(0o700)
    assert line.startswith(f"kvd: error: the data directory {d} is read-only (Permission denied)")


def test_cache_permission_problem_is_a_cache_problem(tmp_path: Path) -> None:
    d = tmp_path / "data"
    make_data_dir(d)
    (d / "cache" / "segments").chmod(0)
    try:
        line = one_error(serve(d, checked()))
    finally:
        (d / "cache" / "segments").chmod(0o700)
    assert line.startswith(f"kvd: error: cannot use the KV cache directory {d / 'cache'}")
    assert "model" not in line


@pytest.mark.skipif(os.getuid() != 0, reason="mounting a small tmpfs needs root")
def test_full_disk_at_start(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], check=True)
    try:
        d = mnt / "data"
        make_data_dir(d)
        with open(mnt / "filler", "wb") as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
        line = one_error(serve(d))
        assert line.startswith(f"kvd: error: no space left on the disk holding {d}: kvd could not "
                               "record a single answer, so it does not start. Free some space; ")
        assert f"KV caches in {d / 'cache'}" in line
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _modes(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): oct(stat.S_IMODE(p.lstat().st_mode)) for p in [d, *d.rglob("*")]
            if stat.S_IMODE(p.lstat().st_mode) & 0o077}


def test_everything_created_is_owner_only_under_umask_022(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        d = tmp_path / "fresh"
        make_data_dir(d)
    finally:
        os.umask(old)
    assert {p.name for p in d.iterdir()} >= {"kvd.sqlite", "token", "cache", "models", "kvd.log", "backups"}
    assert any((d / "cache" / "segments").rglob("*.safetensors"))
    assert _modes(d) == {}


def test_an_existing_open_data_dir_is_tightened(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        d = tmp_path / "open"
        d.mkdir(mode=0o755)
        (d / "notes.txt").write_text("an older kvd left this 0644")
        sqlite3.connect(d / "kvd.sqlite").close()
        assert _modes(d)
        proc = DaemonProcess(d)
    finally:
        os.umask(old)
    assert proc.terminate() == 0, "".join(proc.log)
    assert any(f"the data directory {d} was readable by others (mode 0755)" in line for line in proc.log)
    assert _modes(d) == {}
