"""Service life of a real `kvd serve`: one per data dir, a busy port, --detach, stop, logs, status, units."""

from __future__ import annotations

import configparser
import json
import os
import plistlib
import queue
import shlex
import socket
import subprocess
import sys
import threading
from pathlib import Path

from conftest import fed_tokens
from daemon.service.lockfile import is_locked
from daemon.service.unit import LAUNCHD_LABEL, launchd_plist, service_file, systemd_unit
from daemonproc import DaemonProcess

KVD = [sys.executable, "-m", "daemon.cli"]
TIMEOUT = 120


def kvd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVD, *args], capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, **(env or {})})


def test_second_daemon_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    try:
        before = (tmp_path / "daemon.json").read_text()
        out = kvd("serve", "--model", "builtin:tiny", "--port", "0", "--data-dir", str(tmp_path))
        assert out.returncode == 1
        assert out.stderr.splitlines() == [
            f"kvd is already running (pid {d.proc.pid}, {d.url}) for {tmp_path}; "
            f"stop it with: kvd stop --data-dir {tmp_path}"]
        # The refused one touched nothing: the first still serves, and clients still find it.
        assert (tmp_path / "daemon.json").read_text() == before
        with d.client() as c:
            assert c.request("ping")["type"] == "pong"
    finally:
        assert d.terminate() == 0
    assert not is_locked(tmp_path)


def test_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = kvd("serve", "--model", "builtin:tiny", "--port", str(port), "--data-dir", str(tmp_path))
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert errors == [f"kvd: error: port {port} on 127.0.0.1 is already in use (another program, or a kvd "
                      "with another data directory); pick another with --port N or [server] port in "
                      "config.toml (--port 0 picks a free one)"]
    assert "Traceback" not in out.stderr and "kvd: listening" not in out.stderr
    assert out.stderr.splitlines()[-1] == errors[0]  # the last word: no "kvd: stopped" after a start that failed
    assert "stopped" not in out.stderr
    assert not is_locked(tmp_path)


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    lines: queue.Queue[str | None] = queue.Queue()

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=drain, daemon=True).start()
    return lines


def test_detach_status_logs_stop(tmp_path: Path) -> None:
    started = kvd("serve", "--detach", "--model", "builtin:tiny", "--port", "0", "--data-dir", str(tmp_path))
    assert started.returncode == 0, started.stderr
    info = json.loads((tmp_path / "daemon.json").read_text())
    pid, url = info["pid"], info["url"]
    assert f"kvd: started (pid {pid}) on {url}, ready to answer" in started.stderr
    assert is_locked(tmp_path)
    follower = subprocess.Popen([*KVD, "logs", "-f", "-n", "100", "--data-dir", str(tmp_path)],
                                stdout=subprocess.PIPE, text=True)
    try:
        lines = _lines(follower)
        while "kvd: listening on" not in (lines.get(timeout=TIMEOUT) or ""):
            pass  # the tail is printed: `kvd logs -f` follows from here on
        status = kvd("status", "--data-dir", str(tmp_path))
        assert status.returncode == 0, status.stderr
        first = status.stdout.splitlines()[0]
        assert first.startswith(f"pid {pid} · {url} · up ") and first.endswith(f"log {tmp_path / 'kvd.log'}")
        assert "model builtin:tiny" in status.stdout
        assert "0 client(s) connected" in status.stdout  # not counting the status request itself
        # `kvd logs -f` printed the status request's connection as the daemon logged it.
        while "connection open" not in (lines.get(timeout=TIMEOUT) or ""):
            pass
    finally:
        follower.terminate()
        follower.wait(timeout=TIMEOUT)
    shown = kvd("logs", "-n", "3", "--data-dir", str(tmp_path))
    assert shown.returncode == 0 and len(shown.stdout.splitlines()) == 3
    # The banner's stop hint, run as written, stops this daemon (`kvd stop` alone looked in the default dir).
    hint = started.stderr.split("stop it with: ", 1)[1].split("\n", 1)[0]
    assert hint == f"kvd stop --data-dir {shlex.quote(str(tmp_path))}", started.stderr
    assert f"chat: kvchat --data-dir {shlex.quote(str(tmp_path))};" in started.stderr
    stopped = kvd(*shlex.split(hint)[1:])
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stderr.splitlines()[-1].startswith(f"kvd stop: stopped (pid {pid}, ")
    assert not is_locked(tmp_path) and not (tmp_path / "daemon.json").exists()
    log = (tmp_path / "kvd.log").read_text()
    assert "received SIGTERM" in log and log.rstrip().endswith("kvd: stopped")
    again = kvd("stop", "--data-dir", str(tmp_path))
    assert again.returncode == 0 and "not running" in again.stderr


def test_detach_reports_a_start_failure(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    try:
        out = kvd("serve", "--detach", "--model", "builtin:tiny", "--port", "0", "--data-dir", str(tmp_path))
        assert out.returncode == 1
        assert out.stderr.startswith(f"kvd is already running (pid {d.proc.pid}, {d.url})")
        assert len(out.stderr.splitlines()) == 1, out.stderr  # one line, nothing after it
    finally:
        d.terminate()


def test_detach_prints_the_childs_own_error(tmp_path: Path) -> None:
    """A model that does not exist: the child's error is the last word, not a log that lacks it."""
    out = kvd("serve", "--detach", "--model", str(tmp_path / "does-not-exist"), "--port", "0",
              "--data-dir", str(tmp_path / "kvd"))
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    assert lines[-1].startswith(f"kvd: error: model not found: {tmp_path / 'does-not-exist'} does not exist"), lines
    assert "its log" not in out.stderr


def test_detach_waits_for_the_model_and_reports_a_load_that_fails_after_listening(tmp_path: Path) -> None:
    """`--detach` returns once the model is loaded; weights that only fail to load after kvd listens
    are reported by the command itself, with a non-zero exit, not found later in a log."""
    from daemon.models.builtin import ensure_builtin

    model = ensure_builtin("builtin:tiny", tmp_path / "models")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    out = kvd("serve", "--detach", "--model", str(model), "--port", "0", "--data-dir", str(tmp_path / "kvd"))
    assert out.returncode == 1, out.stderr
    lines = out.stderr.splitlines()
    assert any(line.startswith("kvd: error: the model failed to load: ") for line in lines), lines
    assert not any("its log" in line for line in lines), lines  # the child's own words are the story
    assert "started" not in out.stderr and "Traceback" not in out.stderr
    assert not is_locked(tmp_path / "kvd")


def test_systemd_unit_content(tmp_path: Path) -> None:
    argv = ["/opt/kvd env/bin/kvd", "serve", "--data-dir", "/home/u/kvd data"]
    unit = configparser.ConfigParser(interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(systemd_unit(argv))
    assert unit["Service"]["ExecStart"] == "'/opt/kvd env/bin/kvd' serve --data-dir '/home/u/kvd data'"
    assert unit["Service"]["Type"] == "simple" and unit["Service"]["Restart"] == "on-failure"
    assert unit["Service"]["UMask"] == "0077"
    assert unit["Install"]["WantedBy"] == "default.target"


def test_launchd_plist_content(tmp_path: Path) -> None:
    argv = ["/opt/kvd/bin/kvd", "serve", "--data-dir", "/Users/u/kvd"]
    plist = plistlib.loads(launchd_plist(argv, Path("/Users/u/kvd/kvd.log")).encode())
    assert plist["Label"] == LAUNCHD_LABEL and plist["ProgramArguments"] == argv
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["Umask"] == 0o077
    sf = service_file(Path("/Users/u/kvd"), Path("/Users/u/kvd/kvd.log"), None, platform="darwin",
                      home=Path("/Users/u"))
    assert sf.path == Path(f"/Users/u/Library/LaunchAgents/{LAUNCHD_LABEL}.plist")


def test_service_install_writes_the_unit(tmp_path: Path) -> None:
    out = kvd("service", "install", "--data-dir", str(tmp_path / "data"),
              env={"XDG_CONFIG_HOME": str(tmp_path / "config")})
    assert out.returncode == 0, out.stderr
    unit = (tmp_path / "config" / "systemd" / "user" / "kvd.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.endswith(f"serve --data-dir {tmp_path / 'data'}")
    assert "systemctl --user enable --now kvd.service" in out.stderr
    # The command the unit runs is a working kvd.
    assert subprocess.run([exec_start.removeprefix("ExecStart=").split()[0], "--version"],
                          capture_output=True, timeout=TIMEOUT).returncode == 0


def test_non_loopback_host_warns(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, "--host", "0.0.0.0")
    assert d.terminate() == 0
    assert any("not loopback" in line and "the token is then the only guard" in line for line in d.log)


def test_shutdown_cuts_answers_as_it_says_and_they_resume(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    with d.client() as c:
        sid = c.request("session.create")["session"]["id"]
        c.send(type="chat.send", session=sid, text="A long answer, please.", max_tokens=4000, temperature=0)
        deltas = 0
        while deltas < 10:
            deltas += c.recv()["type"] == "chat.delta"
        assert d.terminate() == 0
    log = "".join(d.log)
    assert "cutting 1 answer(s) short (kept as 'cancelled'" in log
    fed = fed_tokens(tmp_path / "kvd.sqlite", sid)

    d = DaemonProcess(tmp_path)
    try:
        with d.client() as c:
            cut = c.request("session.get", session=sid)["messages"][-1]
            assert cut["status"] == "cancelled" and cut["finish_reason"] == "cancelled" and cut["content"]
            _, done = c.chat(sid, "Go on.", max_tokens=4, temperature=0)
    finally:
        d.terminate()
    # Everything fed before the stop, the cut answer included, came back from disk.
    assert done["usage"]["restored_from"] == "disk"
    assert done["usage"]["restored_tokens"] == len(fed) > cut["usage"]["prompt_tokens"]


def test_status_after_kill_9_says_the_pid_is_gone_and_shows_the_log(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    pid = d.proc.pid
    assert d.kill() != 0  # kill -9: daemon.json is left behind, naming a pid that is gone
    assert json.loads((tmp_path / "daemon.json").read_text())["pid"] == pid
    out = kvd("status", "--data-dir", str(tmp_path))
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    assert lines[0] == (f"kvd status: kvd is not running: its pid {pid} (from {tmp_path / 'daemon.json'}) "
                        f"is gone (start it with: kvd serve --data-dir {tmp_path})")
    assert lines[1] == f"kvd status: the last lines of {tmp_path / 'kvd.log'}:"
    log = (tmp_path / "kvd.log").read_text().splitlines()
    assert [line.removeprefix("  ") for line in lines[2:]] == log[-10:]  # the end of the log, as it was left


def test_sessions_prune_lists_first_then_deletes_through_the_daemon(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    try:
        with d.client() as c:
            kept = c.request("session.create", title="kept", origin="kvchat")["session"]["id"]
            c.chat(kept, "hi", max_tokens=2, temperature=0)
            empty = [c.request("session.create", title=f"empty {i}", origin="kvchat")["session"]["id"]
                     for i in range(2)]
            api_empty = c.request("session.create", title="api", origin="api (x/1)")["session"]["id"]
        refused = kvd("sessions", "prune", "--data-dir", str(tmp_path))
        assert refused.returncode == 2 and "--empty, --older-than DAYS and/or --from ORIGIN" in refused.stderr
        dry = kvd("sessions", "prune", "--empty", "--from", "kvchat", "--data-dir", str(tmp_path))
        assert dry.returncode == 0, dry.stderr
        assert sorted(line.split()[0] for line in dry.stdout.splitlines()) == sorted(empty)
        assert "2 of 4 session(s) would be deleted; run again with --yes" in dry.stderr
        with d.client() as c:
            assert len(c.request("session.list")["sessions"]) == 4  # a dry run deletes nothing
        done = kvd("sessions", "prune", "--empty", "--yes", "--data-dir", str(tmp_path))
        assert done.returncode == 0 and "deleted 3 of 4 session(s)" in done.stderr
        with d.client() as c:
            assert [s["id"] for s in c.request("session.list")["sessions"]] == [kept]
        assert api_empty in done.stdout.split()  # without --from: every empty session, the API's too
    finally:
        d.terminate()
    gone = kvd("sessions", "prune", "--empty", "--data-dir", str(tmp_path))
    assert gone.returncode == 1 and "kvd is not running" in gone.stderr
