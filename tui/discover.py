"""Where the daemon is and which token opens it.

Kept apart from the connection so the rules (flags first, then the files the
daemon leaves in its data directory, then the defaults) read in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import protocol

from .errors import KvchatError


@dataclass(frozen=True)
class Endpoint:
    url: str
    token: str | None
    """None when the token file does not exist: kvchat still connects, so that
    a daemon that is not running is reported as such, not as a missing token."""
    token_path: Path


def locate(
    *,
    url: str | None = None,
    data_dir: Path | None = None,
    token_file: Path | None = None,
    known: str | None = None,
) -> Endpoint:
    """The URL and token from flags, else the daemon's data directory, else where kvd was last
    found (`known`: a stopped kvd removes its daemon.json, and comes back where it was), else defaults."""
    data_dir = data_dir if data_dir is not None else protocol.default_data_dir()
    token_path = token_file if token_file is not None else data_dir / protocol.TOKEN_FILE
    if url is None:
        url = protocol.read_daemon_url(data_dir) or known or protocol.default_url()
    return Endpoint(url=url, token=read_token(token_path), token_path=token_path)


def read_token(path: Path) -> str | None:
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise KvchatError(f"cannot read the token file {path}: {exc.strerror or exc}") from exc
    return token or None
