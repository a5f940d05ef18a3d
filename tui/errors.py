"""What can go wrong for kvchat, as exceptions whose text a person can act on.

Every exception here is meant for the user: ``str(exc)`` says what happened
and what to do, and kvchat prints it as one line. Anything else that escapes
is a bug in kvchat and keeps its traceback.

* :exc:`KvchatError`
    * :exc:`NoDaemon`          nothing listens at the URL
    * :exc:`Unreachable`       something is there, but it is not a usable kvd
    * :exc:`TokenMissing`      no token file where kvchat looked
    * :exc:`TokenRefused`      the daemon refused the token kvchat sent
    * :exc:`ConnectionLost`    the daemon went away mid-session
        * :exc:`GaveUp`        and did not come back while kvchat retried
    * :exc:`ServerError`       kvd answered a request with an ``error`` event
"""

from __future__ import annotations

import shlex
from pathlib import Path
from urllib.parse import urlsplit

import protocol


class KvchatError(Exception):
    """An error the user should read; its text says what to do."""


def start_command(data_dir: Path | None = None, url: str | None = None) -> str:
    """`kvd serve`, with the --data-dir kvchat was given (the daemon must use the same one) and, for a
    daemon kvchat talked to (`url`), its port when it is not the default."""
    command = "kvd serve" if data_dir is None else f"kvd serve --data-dir {shlex.quote(str(data_dir))}"
    port = _port(url)
    return command if port is None or port == protocol.DEFAULT_PORT else f"{command} --port {port}"


def _port(url: str | None) -> int | None:
    try:
        return urlsplit(url).port if url else None
    except ValueError:
        return None


class NoDaemon(KvchatError):
    def __init__(self, url: str, data_dir: Path | None = None) -> None:
        where = protocol.default_data_dir() if data_dir is None else data_dir
        if protocol.read_daemon_url(where) is None and url == protocol.default_url():
            # No daemon.json: the URL is kvchat's guess, not where a kvd was; naming its port would mislead.
            said = f"kvd is not running for {where} (it has no {protocol.DAEMON_FILE})"
        elif (running := protocol.running_daemon_url(where)) is not None and running != url:
            super().__init__(protocol.nothing_answers(url, where))  # kvd runs: starting another would not help
            self.url = url
            return
        else:
            said = f"nothing answers at {url}: kvd is not running there"
        super().__init__(f"{said}; start it with `{start_command(data_dir)}` (or `make serve` in its source tree)")
        self.url = url


class Unreachable(KvchatError):
    def __init__(self, url: str, why: str) -> None:
        super().__init__(f"could not talk to kvd at {url}: {why}")
        self.url = url


class TokenMissing(KvchatError):
    def __init__(self, path: Path) -> None:
        super().__init__(
            f"no token at {path}; `kvd serve` creates it on first start "
            "(or pass --token-file / --data-dir to point kvchat at it)"
        )
        self.path = path


class TokenRefused(KvchatError):
    def __init__(self, path: Path | None) -> None:
        where = f"in {path}" if path is not None else "kvchat sent"
        super().__init__(
            f"the daemon refused the token {where}; kvchat must use the token file in the data "
            "directory that daemon runs with (pass the same --data-dir as `kvd serve`, or --token-file)"
        )
        self.path = path


class ConnectionLost(KvchatError):
    def __init__(self, url: str, why: str = "", data_dir: Path | None = None) -> None:
        detail = f" ({why})" if why else ""
        super().__init__(f"lost the connection to kvd at {url}{detail}; if it stopped, start it with "
                         f"`{start_command(data_dir, url)}`")
        self.url = url
        self.why = why


class GaveUp(ConnectionLost):
    def __init__(self, url: str, seconds: float, why: str, data_dir: Path | None = None) -> None:
        KvchatError.__init__(
            self,
            f"kvd at {url} did not come back within {seconds:g} s ({why}); start it with "
            f"`{start_command(data_dir, url)}`, "
            "then carry on: kvchat reconnects on your next message (/attach shows an answer it missed)",
        )
        self.url = url


class ServerError(KvchatError):
    """An ``error`` event: the request failed, the connection is fine."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} ({code})")
        self.code = code
        self.message = message
