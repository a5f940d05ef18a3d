"""kvd across ranks: `kvd serve --ranks N` on one machine, and each rank's start under mlx.launch.

`kvd serve --ranks N` prepares the model (a model whose heads do not divide
by N stops here, with one line), then runs itself N times on free loopback
ports with the environment `mlx.launch -n N --backend ring` gives its ranks
(see `launch` for why not through it). Each process reads its rank from that
environment: rank 0 is the kvd of one machine with a sharded engine (cli.py);
ranks 1..N-1 are followers (engine/follower.py), started by `follow` here.
Across machines the user runs `mlx.launch --hosts ... -- kvd serve`
(docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from common import durable

from ..config import Config, ConfigError
from .control import DETACHED_FLAG
from .logfile import setup_logging

PORTS_FROM = 40000  # where the search for N free consecutive ports starts
HOSTFILE = "ranks.json"  # in the data directory: the ring's addresses for `kvd serve --ranks N`
FOLLOWERS_GRACE = 30.0  # seconds the followers get to end after rank 0 did


def launched() -> int | None:
    """This process's rank when mlx.launch started it, else None."""
    rank = os.environ.get("MLX_RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


def rank_timeout() -> float:
    """Seconds a collective may take before a peer counts as lost: $KVD_RANK_TIMEOUT, else lockstep's 30."""
    from ..engine.lockstep import TIMEOUT

    text = os.environ.get("KVD_RANK_TIMEOUT")
    if text is None:
        return TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"KVD_RANK_TIMEOUT must be a number of seconds above 0, not {text!r}")
    return seconds


def blas_threads(config: Config) -> int:
    """BLAS threads for this rank: the configured count, else the CPUs shared by the ranks on this host.

    Two ranks each running as many BLAS threads as there are CPUs spin against
    each other (OpenBLAS threads busy-wait), so ranks that share a host share
    its CPUs; the hostfile says how many of them do.
    """
    from ..engine.doorbell import ring_hosts
    from .blas import usable_cpus

    rank = launched()
    hosts = ring_hosts() if rank is not None and not config.blas_threads else None
    if not hosts or rank is None or rank >= len(hosts):
        return config.blas_threads
    return max(1, usable_cpus() // hosts.count(hosts[rank]))


def join(config: Config) -> tuple[Config, Any]:
    """Join the group (after the BLAS is in place: this imports mlx): the config with this rank
    and the group's size, and the Lockstep; one rank alone gets its config back and None."""
    from ..engine.lockstep import from_env

    lockstep = from_env(rank_timeout()) if launched() is not None else None
    if lockstep is None:
        return config, None
    return replace(config, rank=lockstep.rank, world_size=lockstep.size), lockstep


def follow(config: Config, *, verbose: bool) -> int:
    """A follower rank's whole life: BLAS, the group, the model, then rank 0's word."""
    from common.printable import printable

    from ..engine.follower import serve
    from ..models.sources import ModelError, prepare_model
    from .blas import preload_blas

    config = replace(config, rank=launched() or 0)
    config.rank_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    setup_logging(verbose=verbose, log_file=config.rank_dir / "kvd.log")
    for h in _stderr_handlers():
        h.setLevel("WARNING")  # the terminal tells rank 0's story; each rank's is in its own log
    preload_blas(config.blas, threads=blas_threads(config))
    config, lockstep = join(config)
    if lockstep is None:
        print(f"kvd: error: rank {config.rank} found no group to join (is MLX_HOSTFILE set?)", file=sys.stderr)
        return 1
    durable.write_atomic(config.rank_dir / "pid", f"{os.getpid()}\n", mode=0o600)
    try:
        model_dir = prepare_model(config.model, config.models_dir)
    except ModelError as e:
        lockstep.fatal(f"the model cannot be prepared here: {printable(str(e))}")
    return serve(config, lockstep, model_dir)


def _stderr_handlers() -> list[Any]:
    import logging

    return [h for h in logging.getLogger().handlers if type(h) is logging.StreamHandler]


def free_ports(n: int, start: int = PORTS_FROM) -> int:
    """The first of `n` consecutive loopback ports nothing listens on now."""
    for first in range(start, 65535 - n):
        if all(_free(first + i) for i in range(n)):
            return first
    raise OSError("no free loopback ports for the ranks")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def hostfile(path: Path, ranks: int, port: int) -> Path:
    """The ring backend's hostfile for `ranks` ranks on loopback from `port` (mlx.launch writes the same)."""
    durable.write_atomic(path, json.dumps([[f"127.0.0.1:{port + r}"] for r in range(ranks)]), mode=0o600)
    return path


def _watch(procs: list[subprocess.Popen[bytes]]) -> None:
    """Until rank 0 ends. Rank 0 names a follower that died (lockstep.py), but only once it is past its
    start: a follower that dies before then leaves it waiting, so it is ended here, with one line."""
    grace = rank_timeout() + 5.0
    dead_at: float | None = None
    while True:
        try:
            procs[0].wait(timeout=0.5)
            return
        except subprocess.TimeoutExpired:
            pass
        dead = [(r, p.returncode) for r, p in enumerate(procs) if r and p.poll() not in (None, 0)]
        if not dead:
            continue
        dead_at = dead_at or time.monotonic()
        if time.monotonic() - dead_at > grace:
            r, code = dead[0]
            how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            with contextlib.suppress(OSError):  # detached, nobody may be reading
                print(f"kvd: error: rank {r} ended ({how}) and rank 0 did not notice in {grace:g} s; stopping "
                      f"rank 0; rank {r}'s log is <data_dir>/rank-{r}/kvd.log", file=sys.stderr, flush=True)
            procs[0].kill()
            procs[0].wait()
            return


def launch(argv: Sequence[str], config: Config, ranks: int) -> int:
    """Run `kvd <argv>` as `ranks` local ranks; 0 when every rank ended well.

    Each rank gets the environment mlx.launch gives it (MLX_RANK, MLX_HOSTFILE);
    kvd starts them itself because mlx.launch's output relay spins a core per
    rank (it polls each rank's always-writable stdin pipe: 73% of a core,
    measured idle here), which on a shared machine is the model's core. Across
    machines, mlx.launch starts `kvd serve` (docs/distributed.md).
    SIGINT and SIGTERM go to rank 0 alone, which stops the followers itself
    after paging every cache out; rank 0 names a rank that died.
    """
    from ..engine.shard import ShardError, check_shardable
    from .startup import prepare

    model_dir = prepare(config)
    if model_dir is None:
        return 1
    try:
        check_shardable(config.model, json.loads((model_dir / "config.json").read_text()), ranks)
    except ShardError as e:
        print(f"kvd: error: {e}", file=sys.stderr, flush=True)
        return 1
    hosts = hostfile(config.data_dir / HOSTFILE, ranks, free_ports(ranks))
    # Detached (kvd serve --detach), rank 0 leaves the start-up pipe once it answers; the followers'
    # warnings go to their own logs only, so none of them writes into a pipe nobody reads.
    quiet = DETACHED_FLAG in argv
    procs = [subprocess.Popen([sys.executable, "-m", "daemon.cli", *argv], stdin=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL if quiet and r else None,
                              env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts)},
                              start_new_session=True)  # a terminal's Ctrl-C reaches this process alone
             for r in range(ranks)]

    def stop(signum: int, frame: Any) -> None:
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    _watch(procs)
    # The followers end on rank 0's stop, or on losing it; never left behind.
    deadline = time.monotonic() + FOLLOWERS_GRACE
    for p in procs[1:]:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return 0 if all(p.returncode == 0 for p in procs) else 1
