"""`kvd sessions prune` has no traceback path (issue 35): every way of failing to reach the daemon is one
line that says what to do, and nothing is deleted."""

from __future__ import annotations

import http.server
import json
import socket
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import protocol as p
from daemon.service import prune


def data_dir(tmp_path: Path, url: str, *, token: bool = True) -> Path:
    d = tmp_path / "kvd"
    d.mkdir()
    (d / p.DAEMON_FILE).write_text(json.dumps({"url": url, "pid": 1, "log_file": str(d / "kvd.log")}))
    if token:
        (d / p.TOKEN_FILE).write_text("secret\n")
    return d


@pytest.fixture(params=["HTTP/1.0", "HTTP/1.1"])
def plain_http(request: pytest.FixtureRequest) -> Iterator[tuple[int, str]]:
    """A plain HTTP server (not kvd) on a loopback port: 200 and a web page for every GET."""
    class Page(http.server.BaseHTTPRequestHandler):
        protocol_version = request.param

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "18")
            self.end_headers()
            self.wfile.write(b"<html>hello</html>")

        def log_message(self, *args: object) -> None:
            pass

    with socketserver.TCPServer(("127.0.0.1", 0), Page) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield server.server_address[1], request.param
        server.shutdown()


@pytest.fixture
def garbage() -> Iterator[int]:
    """A TCP server that answers any connection with bytes that are not HTTP, then hangs up."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"\x00\x01 not http at all\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_line(capsys: pytest.CaptureFixture[str], d: Path) -> str:
    assert prune.main(d, empty=True, older_than=None, origin="any", yes=True) == 1
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert out.out == "" and len(lines) == 1 and lines[0].startswith("kvd sessions prune: "), out
    return lines[0]


def test_not_a_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line(capsys, data_dir(tmp_path, "not a url"))
    assert "'not a url', which is not kvd's websocket URL" in line and "kvd serve --detach" in line


def test_an_http_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line(capsys, data_dir(tmp_path, "http://127.0.0.1:1/v1"))
    assert "not kvd's websocket URL (ws://HOST:PORT/v1)" in line


def test_a_ws_url_that_does_not_parse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line(capsys, data_dir(tmp_path, "ws://[::1/v1\x1b[2J"))
    assert "not a URL kvd could have written" in line and "\\x1b[2J" in line and "\x1b" not in line


def test_the_token_file_missing_while_the_daemon_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line(capsys, data_dir(tmp_path, f"ws://127.0.0.1:{free_port()}/v1", token=False))
    assert "cannot read kvd's token file" in line and "No such file" in line


def test_a_plain_http_server_at_the_url(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        plain_http: tuple[int, str]) -> None:
    port, version = plain_http
    line = one_line(capsys, data_dir(tmp_path, f"ws://127.0.0.1:{port}/v1"))
    if version == "HTTP/1.0":  # no websocket handshake at all
        assert "does not speak kvd's protocol (did not receive a valid HTTP response)" in line
    else:  # a handshake, with the wrong status
        assert "is not the kvd of" in line and "it answered HTTP 200" in line


def test_something_that_is_not_http_at_the_url(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               garbage: int) -> None:
    line = one_line(capsys, data_dir(tmp_path, f"ws://127.0.0.1:{garbage}/v1"))
    assert "does not speak kvd's protocol" in line


def test_nothing_listening(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line(capsys, data_dir(tmp_path, f"ws://127.0.0.1:{free_port()}/v1"))
    assert "cannot reach kvd at" in line and "Connection refused" in line


def test_the_command_line_prints_one_line_and_no_traceback(tmp_path: Path, plain_http: tuple[int, str]) -> None:
    d = data_dir(tmp_path, f"ws://127.0.0.1:{plain_http[0]}/v1")
    out = subprocess.run([sys.executable, "-m", "daemon.cli", "sessions", "prune", "--empty", "--yes",
                          "--data-dir", str(d)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
