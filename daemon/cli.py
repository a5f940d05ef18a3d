"""`kvd`: the daemon's command line.

Nothing here imports mlx at module level: OpenBLAS must be interposed before
`mlx.core` is first imported (daemon/blas.py), and that happens in `serve`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
from pathlib import Path

import anyio

from . import __version__
from .config import Config, ConfigError, load_config
from .protocol import DAEMON_FILE, TOKEN_FILE

log = logging.getLogger("kvd")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvd", description="kvd: a local chat daemon for MLX models "
                                     "that keeps every conversation's KV cache.")
    parser.add_argument("--version", action="version", version=f"kvd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config", type=Path, help="a config.toml (default: built-in defaults)")
    s.add_argument("--model", help="builtin:smollm2 (the default), builtin:tiny, builtin:tiny-swa, "
                   "a .gguf file, a local mlx-lm model directory or a Hugging Face repo id")
    s.add_argument("--port", type=int, help="port on the host (0 picks a free one)")
    s.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--data-dir", type=Path, help="where the database, token and caches live")
    s.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    st = sub.add_parser("status", help="show a running daemon's cache tiers")
    st.add_argument("--data-dir", type=Path, help="the daemon's data directory")
    st.add_argument("--url", help="the daemon's URL (default: from the data directory)")
    st.add_argument("--json", action="store_true", help="print the raw status as JSON")
    return parser


def ensure_token(data_dir: Path) -> str:
    """The handshake token: created once with mode 0600, reused across restarts."""
    path = data_dir / TOKEN_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            log.warning("%s was readable by others; setting mode 0600", path)
            path.chmod(0o600)
        token = path.read_text().strip()
        if token:
            return token
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())
    return token


def _write_daemon_file(data_dir: Path, url: str) -> Path:
    path = data_dir / DAEMON_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "pid": os.getpid(), "version": __version__}, f)
    os.replace(tmp, path)
    return path


def serve(config: Config) -> int:
    from .blas import preload_blas

    blas = preload_blas(config.blas)
    log.info("%s", blas.reason)

    from sessions import Store

    from .engine import Engine
    from .server import Daemon
    from .startup import prepare, until_stopped

    config.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = ensure_token(config.data_dir)
    model_dir = prepare(config)  # before listening: a model that cannot load stops kvd here
    if model_dir is None:
        return 1
    store = Store(config.db_path)
    if n := store.recover_interrupted():
        log.warning("%d answer(s) were cut off by a crash; they are kept, marked 'error'", n)
    engine = Engine(config, model_dir)
    engine.start()
    daemon = Daemon(config, store, engine, token)

    async def main() -> str | None:
        async with anyio.create_task_group() as tg:
            url = await tg.start(daemon.run)
            daemon_file = _write_daemon_file(config.data_dir, url)
            print(f"kvd: listening on {url} (model {config.model}, data {config.data_dir})",
                  file=sys.stderr, flush=True)
            failed = await until_stopped(engine)  # a signal, or the model failing to load
            daemon.shutdown()
        daemon_file.unlink(missing_ok=True)
        return failed

    try:
        failed = anyio.run(main)
    finally:
        store.close()
    log.info("stopped")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
                        format="kvd: %(message)s", stream=sys.stderr)
    if args.command == "serve":
        try:
            config = load_config(args.config, model=args.model, port=args.port, host=args.host,
                                 data_dir=args.data_dir)
        except ConfigError as e:
            print(f"kvd: error: {e}", file=sys.stderr)
            return 2
        return serve(config)
    if args.command == "status":
        from .protocol import default_data_dir
        from .statuscmd import main as status_main

        return status_main(args.data_dir or default_data_dir(), args.url, args.json)
    return 2


if __name__ == "__main__":
    sys.exit(main())
