"""`kvd`'s command line: each subcommand dispatches to its own function, and argparse refuses bad values
with the subcommand's own usage, before anything runs."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from daemon.cli import _parser, main
from daemon.service.prune import DAY, chosen
from tui.listing import origin_label


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What kvd says on stderr when argparse refuses `argv` (exit status 2, nothing run)."""
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    err: str = capsys.readouterr().err
    return err


def test_every_subcommand_names_its_function() -> None:
    def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return [parser]
        return [leaf for sub in subs for child in sub.choices.values() for leaf in parsers(child)]

    leaves = parsers(_parser())
    assert {p.prog for p in leaves} == {"kvd serve", "kvd status", "kvd stop", "kvd logs", "kvd sessions prune",
                                        "kvd models", "kvd ps", "kvd service"}
    for p in leaves:
        assert callable(p.get_default("func")) and p.get_default("parser") is p, p.prog


@pytest.mark.parametrize("ranks", ["0", "-1", "two"])
def test_ranks_below_one_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str], ranks: str) -> None:
    err = refused(capsys, "serve", "--ranks", ranks)
    assert err.startswith("usage: kvd serve ") and "argument --ranks: " in err


def test_an_unknown_flag_shows_the_subcommands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "serve", "--frobnicate")
    assert err.startswith("usage: kvd serve ")
    assert err.rstrip().endswith("kvd serve: error: unrecognized arguments: --frobnicate")
    err = refused(capsys, "sessions", "prune", "--empty", "--frobnicate")
    assert err.startswith("usage: kvd sessions prune ") and "unrecognized arguments: --frobnicate" in err


@pytest.mark.parametrize("days", ["nan", "inf", "-inf", "0", "-1", "1e-300", "0.00001", "soon"])
def test_older_than_must_be_a_finite_number_of_days_of_at_least_a_second(
        capsys: pytest.CaptureFixture[str], days: str) -> None:
    err = refused(capsys, "sessions", "prune", "--older-than", days)
    assert err.startswith("usage: kvd sessions prune ") and "argument --older-than: " in err


@pytest.mark.parametrize("days, parsed", [("30", 30.0), ("0.5", 0.5), ("0.0000116", 0.0000116)])
def test_older_than_takes_days(days: str, parsed: float) -> None:
    assert _parser().parse_args(["sessions", "prune", "--older-than", days]).older_than == parsed


@pytest.mark.parametrize("timeout", ["nan", "0", "-5"])
def test_stop_timeout_must_be_positive(capsys: pytest.CaptureFixture[str], timeout: str) -> None:
    assert refused(capsys, "stop", "--timeout", timeout).startswith("usage: kvd stop ")


def test_prune_takes_every_origin_the_session_list_shows() -> None:
    sessions = [{"id": origin, "origin": origin, "updated_at": 0.0, "message_count": 0}
                for origin in ("kvchat", "kvchat one-shot", "api (curl/8)", "websocket", "my-client 2")]
    for s in sessions:
        word = origin_label(s["origin"]) if s["origin"] != "my-client 2" else "ws"  # a client's own name: ws
        args = _parser().parse_args(["sessions", "prune", "--from", word])
        assert s in chosen(sessions, empty=False, older_than=None, origin=args.origin, now=0.0), word
    one_shots = chosen(sessions, empty=False, older_than=None, origin="one-shot", now=0.0)
    assert [s["id"] for s in one_shots] == ["kvchat one-shot"]
    kvchat = chosen(sessions, empty=False, older_than=None, origin="kvchat", now=0.0)
    assert [s["id"] for s in kvchat] == ["kvchat", "kvchat one-shot"]  # kvchat's own, its one-shots too


def test_older_than_picks_by_age() -> None:
    sessions = [{"id": "old", "updated_at": 1.0}, {"id": "new", "updated_at": 9 * DAY}]
    assert [s["id"] for s in chosen(sessions, empty=False, older_than=2, origin="any", now=10 * DAY)] == ["old"]


def test_main_dispatches_to_the_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()  # main sets up logging for the process: give it back as pytest had it
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    log = tmp_path / "kvd.log"
    log.write_text("one\ntwo\nthree\n")
    assert main(["logs", "--log-file", str(log), "-n", "2"]) == 0
    assert capsys.readouterr().out == "two\nthree\n"
    assert main(["logs", "--log-file", str(tmp_path / "none.log")]) == 1
    assert "no log at" in capsys.readouterr().err
