"""`kvd`: the daemon's command line.

Nothing here imports mlx at module level: OpenBLAS must be interposed before
`mlx.core` is first imported (daemon/service/blas.py), and that happens in `serve`.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import anyio

from common import durable, origins
from common.threadname import name_thread
from protocol import TOKEN_FILE, api_url, default_data_dir, default_url

from . import __version__
from .config import Config, ConfigError, load_config
from .service import backup, models, preflight
from .service.control import (
    ANSWERING_MARK,
    DETACHED_FLAG,
    detach,
    leave_terminal,
    logs,
    read_daemon_file,
    running_line,
    stop,
    write_daemon_file,
)
from .service.lockfile import AlreadyRunning, DataDirLock
from .service.logfile import setup_logging
from .service.preflight import StartError

if TYPE_CHECKING:
    from .server import Daemon
    from .transcripts import Transcripts
if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger("kvd")

LOOPBACK = ("127.0.0.1", "::1", "localhost")
BACKUP_CHECK_EVERY = 60.0  # seconds between looks at whether a backup is due


def _at_least_one(text: str) -> int:
    """An argparse type: a whole number of 1 or more (`--ranks 0` is refused with the usage)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


MIN_DAYS = 1 / 86400  # one second: a shorter age picks the same sessions as 0 (every one), which is refused


def _days(text: str) -> float:
    """An argparse type: a finite number of days, at least one second's worth (nan, inf, 0, -1 and 1e-300 refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days") from None
    if not math.isfinite(value) or value < MIN_DAYS:
        raise argparse.ArgumentTypeError(f"must be a number of days of at least one second ({MIN_DAYS:.7f}), "
                                         f"such as 30 or 0.5, not {text}")
    return value


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvd", description="kvd: a local chat daemon for MLX models that keeps every conversation's KV "
        f"cache. kvchat connects to {default_url()}; OpenAI clients to {api_url(default_url())} with the "
        f"token in the data directory ({default_data_dir() / TOKEN_FILE} by default) as the API key.")
    parser.add_argument("--version", action="version", version=f"kvd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the daemon")
    s.set_defaults(func=_serve_command, parser=s)
    s.add_argument("--config", type=Path, help="a config.toml (default: built-in defaults)")
    s.add_argument("--model", help="builtin:smollm2 (the default), builtin:gemma3, builtin:tiny, "
                   "builtin:tiny-swa, a .gguf file, a local mlx-lm model directory, ollama:NAME[:TAG], "
                   "hf:ORG/NAME (already in the Hugging Face cache) or a Hugging Face repo id; "
                   "`kvd models` lists them")
    s.add_argument("--port", type=int, help="port on the host (0 picks a free one)")
    s.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--data-dir", type=Path, help="where the database, token and caches live")
    s.add_argument("--log-file", type=Path, help="the log file (default: kvd.log in the data directory)")
    s.add_argument("--speculate", choices=["auto", "off"],
                   help="speculative decoding (default auto: where the answer repeats the context)")
    s.add_argument("--ranks", type=_at_least_one, metavar="N",
                   help="split the model across N local ranks (MLX ring backend; docs/distributed.md)")
    s.add_argument("--detach", action="store_true", help="run in the background; return once it listens")
    s.add_argument(DETACHED_FLAG, action="store_true", help=argparse.SUPPRESS)
    s.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    st = sub.add_parser("status", help="show a running daemon: pid, URL, uptime, cache tiers")
    st.set_defaults(func=_status_command, parser=st)
    st.add_argument("--data-dir", type=Path, help="the daemon's data directory")
    st.add_argument("--url", help="the daemon's URL (default: from the data directory)")
    st.add_argument("--json", action="store_true", help="print the raw status as JSON")
    sp = sub.add_parser("stop", help="stop the running daemon (pages every cache out first)")
    sp.set_defaults(func=lambda args, argv: stop(_data_dir(args), args.timeout), parser=sp)
    sp.add_argument("--data-dir", type=Path, help="the daemon's data directory")
    sp.add_argument("--timeout", type=_seconds, default=120.0, help="seconds to wait (default 120)")
    lg = sub.add_parser("logs", help="show the daemon's log")
    lg.set_defaults(func=_logs_command, parser=lg)
    lg.add_argument("--data-dir", type=Path, help="the daemon's data directory")
    lg.add_argument("--log-file", type=Path, help="the log file, if not the default")
    lg.add_argument("-n", "--lines", type=int, default=50, help="lines to show (default 50)")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    ss = sub.add_parser("sessions", help="tidy the session list (through the running daemon)")
    ssp = ss.add_subparsers(dest="sessions_command", required=True)
    pr = ssp.add_parser("prune", help="delete sessions: a dry run that lists them unless --yes")
    pr.set_defaults(func=_prune_command, parser=pr)
    pr.add_argument("--data-dir", type=Path, help="the daemon's data directory")
    pr.add_argument("--empty", action="store_true", help="sessions with no messages")
    pr.add_argument("--older-than", type=_days, metavar="DAYS", help="sessions not used for DAYS days")
    pr.add_argument("--from", dest="origin", choices=origins.KINDS, default="any",
                    help="sessions made by kvchat (its one-shots too), one-shot (kvchat \"question\"), api "
                    "(OpenAI clients), ws (other websocket clients): the session list's words; default any")
    pr.add_argument("--yes", action="store_true", help="delete them (without it: only list them)")
    models.add_commands(sub)  # kvd models [pull NAME], kvd ps
    sv = sub.add_parser("service", help="run kvd at login (systemd user unit or launchd agent)")
    sv.set_defaults(func=_service_command, parser=sv)
    sv.add_argument("action", choices=["install"], help="write the unit file")
    sv.add_argument("--data-dir", type=Path, help="the data directory the service uses")
    sv.add_argument("--config", type=Path, help="a config.toml the service passes to kvd serve")
    sv.add_argument("--print", action="store_true", help="print the file instead of writing it")
    return parser


def ensure_token(data_dir: Path) -> str:
    """The handshake token: created once with mode 0600, reused across restarts."""
    path = data_dir / TOKEN_FILE
    try:
        if path.stat().st_mode & 0o077:
            log.warning("%s was readable by others; setting mode 0600", path)
            path.chmod(0o600)
        token = path.read_text().strip()
    except FileNotFoundError:
        token = ""
    except OSError as e:
        raise StartError(f"cannot read the token file {path}: {e.strerror or e}; kvd must own "
                         f"everything in its data directory (chown -R $USER {data_dir})") from None
    if not token:
        token = secrets.token_urlsafe(32)
        durable.write_atomic(path, token + "\n", mode=0o600)
    return token


def serve(config: Config, *, verbose: bool = False, detached: bool = False) -> int:
    """Check everything, take the data directory, listen, serve until SIGTERM; 1 with one line on failure."""
    setup_logging(verbose=verbose, log_file=None)
    lock = DataDirLock(config.data_dir)
    try:
        preflight.prepare_data_dir(config.data_dir)
        lock.acquire()
    except AlreadyRunning:
        print(running_line(config.data_dir), file=sys.stderr)
        return 1
    except (StartError, OSError) as e:
        print(f"kvd: error: {e}", file=sys.stderr)
        return 1
    try:
        try:
            setup_logging(verbose=verbose, log_file=config.log_path)
        except OSError as e:
            raise StartError(f"cannot write the log file {config.log_path}: {e.strerror or e}; "
                             "pick another with --log-file") from None
        return _serve_locked(config, detached=detached)
    except BaseException as e:
        if (start_error := _find(e, StartError)) is None:
            raise
        log.error("error: %s", start_error)
        return 1
    finally:
        lock.release()


E = TypeVar("E", bound=BaseException)


def _find(e: BaseException, kind: type[E]) -> E | None:
    """The `kind` exception in `e`, also when task groups wrapped it."""
    if isinstance(e, kind):
        return e
    if isinstance(e, BaseExceptionGroup):
        for inner in e.exceptions:
            if (found := _find(inner, kind)) is not None:
                return found
    return None


def _serve_locked(config: Config, *, detached: bool) -> int:
    from .device import missing_backend
    from .service.blas import preload_blas

    if no_backend := missing_backend():
        raise StartError(no_backend)

    if config.host not in LOOPBACK:
        log.warning("listening on %s, not loopback: anyone who can reach this address and holds the "
                    "token can read every conversation; the token is then the only guard", config.host)
    from .engine.heap import tune_as_policy
    from .service.ranks import blas_threads

    log.info("%s", tune_as_policy())  # malloc first: before any thread, before MLX
    blas = preload_blas(config.blas, threads=blas_threads(config))
    for line in blas.rejected:
        log.warning("BLAS: %s", line)
    (log.info if blas.loaded or "disabled" in blas.reason else log.warning)("%s", blas.reason)

    from .engine.thread import Engine
    from .server import Daemon
    from .service.ranks import join
    from .service.startup import prepare

    config, lockstep = join(config)  # under mlx.launch: rank 0 of a sharded model
    token = ensure_token(config.data_dir)
    model_dir = prepare(config)  # before listening: a model that cannot load stops kvd here
    if model_dir is None:
        return 1
    store = preflight.open_store(config.db_path, config.backups_dir)
    served = False  # "stopped" only after serving: a start that failed ends with its error line alone
    try:
        preflight.check_cache_dir(config.cache_dir)
        if preflight.put_back_backup(store):
            log.info("%s is a backup put back: serving it as it is", config.db_path)
        if lost := preflight.lost_commits(store, config.db_path):
            log.warning("%s", preflight.loss_line(lost, store, config.db_path, config.cache_dir, config.backups_dir))
            log.warning("no backups while this daemon runs: they would replace the ones from before "
                        "the loss")
        if n := store.recover_interrupted():
            log.warning("%d answer(s) were cut off by a crash; they are kept, marked 'error'", n)
        engine = Engine(config, model_dir, lockstep=lockstep)
        daemon = Daemon(config, store, engine, token)
        daemon.blas = blas.reason
        try:
            daemon.bind()
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise StartError(f"port {config.port} on {config.host} is already in use (another "
                                 "program, or a kvd with another data directory); pick another with "
                                 "--port N or [server] port in config.toml (--port 0 picks a free "
                                 "one)") from None
            raise StartError(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}") from None
        engine.start()
        served = True
        name_thread("kvd-loop")  # the event loop's thread (top -H, py-spy, bench/hostcost.py)
        failed = anyio.run(_main, config, daemon, detached, not lost)
        if not lost and not failed:
            _back_up(config, "at shutdown")
    finally:
        store.close()
        if served:
            log.info("stopped")
    return 1 if failed else 0


async def _announce_ready(daemon: Daemon, detached: bool) -> None:
    """Say when the model is loaded; a detached daemon keeps its start-up pipe until then (`--detach` waits)."""
    while not daemon.engine.ready.is_set():
        await anyio.sleep(0.05)  # a threading.Event, set by the engine thread
    if daemon.engine.load_error is None:
        log.info("%s", ANSWERING_MARK.removeprefix("kvd: "))
        if detached:
            leave_terminal()


async def _main(config: Config, daemon: Daemon, detached: bool, backups_on: bool) -> bool:
    """Serve until SIGTERM/SIGINT (False) or until the model fails to load after all (True)."""
    from .service.startup import load_failure

    failed = False
    # The signal handler is in place before the port opens: a SIGTERM right after
    # "listening" is a clean stop, not the default death.
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with anyio.create_task_group() as tg:
            url = await tg.start(daemon.run)
            daemon_file = write_daemon_file(config.data_dir, url, config.log_path)
            log.info("listening on %s (pid %d, model %s, data %s, log %s)", url, os.getpid(), config.model,
                     config.data_dir, config.log_path)
            if config.world_size > 1:
                log.info("rank 0 of %d: the model is split across %d ranks (caches in %s)", config.world_size,
                         config.world_size, config.cache_dir)
            log.info("OpenAI API at %s (API key: the token in %s)", api_url(url), config.data_dir / TOKEN_FILE)
            log.info("Anthropic API at %s (the same key; coding agents: docs/agents.md)",
                     api_url(url).removesuffix("/v1"))
            tg.start_soon(_announce_ready, daemon, detached)
            backups = anyio.CancelScope()
            if backups_on:
                tg.start_soon(_scheduled_backups, config, daemon.turns.transcripts, backups)
            async with anyio.create_task_group() as until:

                async def on_signal() -> None:
                    async for signum in signals:
                        log.info("received %s", signal.Signals(signum).name)
                        break
                    until.cancel_scope.cancel()

                async def on_load_failure() -> None:
                    nonlocal failed
                    if (why := await load_failure(daemon.engine)) is not None:
                        log.error("error: the model failed to load: %s", why)
                        failed = True
                        until.cancel_scope.cancel()

                until.start_soon(on_signal)
                until.start_soon(on_load_failure)
            backups.cancel()
            daemon.shutdown()
            daemon_file.unlink(missing_ok=True)
    return failed


async def _scheduled_backups(config: Config, transcripts: Transcripts, scope: anyio.CancelScope) -> None:
    """Back up daily and after every backup.AFTER_MESSAGES new messages, while kvd runs."""
    with scope:
        while True:
            messages = await transcripts.read(lambda store: store.message_count())  # on the store's writer
            if (why := await anyio.to_thread.run_sync(backup.wanted, messages, config.backups_dir)) is not None:
                await anyio.to_thread.run_sync(_back_up, config, why)
            await anyio.sleep(BACKUP_CHECK_EVERY)


def _back_up(config: Config, when: str) -> None:
    try:
        path = backup.back_up(config.db_path, config.backups_dir)
    except Exception as e:  # a backup must never stop the daemon or lose its shutdown
        log.warning("could not back up the transcript %s: %s", when, e)
        return
    log.info("backed up the transcript %s to %s", when, path)


# -- the subcommands: each takes the parsed arguments and the raw ones, and returns the exit status --


def _data_dir(args: argparse.Namespace) -> Path:
    return args.data_dir or default_data_dir()


def _serve_command(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        config = load_config(args.config, model=args.model, port=args.port, host=args.host,
                             data_dir=args.data_dir, log_file=args.log_file, speculate=args.speculate)
    except ConfigError as e:
        print(f"kvd: error: {e}", file=sys.stderr)
        return 2
    from .service import ranks

    rank = ranks.launched()
    sharded = rank is not None or (args.ranks or 1) > 1
    try:
        if sharded:
            ranks.rank_timeout()  # read by every rank; a bad value stops them all here, with one line
    except ConfigError as e:
        print(f"kvd: error: {e}", file=sys.stderr)
        return 2
    if args.detach:
        return detach([a for a in argv if a != "--detach"], config.log_path, config.data_dir)
    if rank is None and (args.ranks or 1) > 1:
        return ranks.launch(argv, config, args.ranks)
    if rank:
        return ranks.follow(config, verbose=args.verbose)
    return serve(config, verbose=args.verbose, detached=args.detached_child)


def _status_command(args: argparse.Namespace, argv: list[str]) -> int:
    from .service.status import main as status_main

    return status_main(_data_dir(args), args.url, args.json)


def _prune_command(args: argparse.Namespace, argv: list[str]) -> int:
    from .service.prune import main as prune_main

    return prune_main(_data_dir(args), empty=args.empty, older_than=args.older_than, origin=args.origin,
                      yes=args.yes)


def _logs_command(args: argparse.Namespace, argv: list[str]) -> int:
    data_dir = _data_dir(args)
    return logs(args.log_file or Path(read_daemon_file(data_dir).get("log_file") or data_dir / "kvd.log"),
                args.lines, args.follow)


def _service_command(args: argparse.Namespace, argv: list[str]) -> int:
    from .service.unit import install, service_file

    data_dir = _data_dir(args).expanduser().resolve()
    sf = service_file(data_dir, data_dir / "kvd.log", args.config)
    if args.print:
        print(sf.content, end="")
        return 0
    install(sf)
    print(f"kvd: wrote {sf.path}; start it now and at every login with:", file=sys.stderr)
    for step in sf.next_steps:
        print(f"  {step}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    given = argv if argv is not None else sys.argv[1:]
    args, unknown = _parser().parse_known_args(given)
    if unknown:  # said by the subcommand's own parser, so the usage shown is the subcommand's
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.func is not _serve_command:
        setup_logging(verbose=False, log_file=None)
    code: int = args.func(args, given)
    return code


if __name__ == "__main__":
    sys.exit(main())
