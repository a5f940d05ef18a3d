"""kvd's log file on a full disk: one line on stderr, once, never a `--- Logging error ---` block.

/dev/full is a file every write to fails with ENOSPC, as a full disk's does.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.service.logfile import LogFile, setup_logging


@pytest.fixture
def restored_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_a_log_file_that_cannot_be_written_is_one_line_on_stderr(capsys: pytest.CaptureFixture[str],
                                                                  restored_logging: None) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = LogFile(Path("/dev/full"), maxBytes=1 << 20, backupCount=1, encoding="utf-8")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    log = logging.getLogger("kvd.writer")
    for i in range(40):  # what the transcript writer logs while the disk is full: errors with their cause
        try:
            try:
                raise sqlite3.OperationalError("database or disk is full")
            except sqlite3.OperationalError as e:
                raise RuntimeError(f"commit {i} failed") from e
        except RuntimeError:
            log.exception("could not commit the queued writes")
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "kvd: the log file /dev/full is not being written ([Errno 28] No space left on device); "
        "kvd's lines go to stderr only"]


def test_a_record_that_cannot_be_formatted_is_still_reported(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path, restored_logging: None) -> None:
    """Only a file that cannot be written is quieted: a bad log call stays loud."""
    setup_logging(verbose=False, log_file=tmp_path / "kvd.log", stderr=False)
    logging.getLogger("kvd").info("%d answers", "many")
    err = capsys.readouterr().err
    assert "--- Logging error ---" in err and "not being written" not in err
