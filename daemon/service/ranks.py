"""kvd across ranks: `kvd serve --ranks N` on one machine, and each rank's start under mlx.launch.

`kvd serve --ranks N` prepares the model (a model whose heads do not divide
by N stops here, with one line), then runs itself N times through
`mlx.launch -n N --backend ring` on free loopback ports and relays their
output. Each launched process reads its rank from mlx.launch's environment:
rank 0 is the kvd of one machine with a sharded engine (cli.py); ranks 1..N-1
are followers (engine/follower.py), started by `follow` here. Across machines
the user runs mlx.launch with --hosts or a hostfile (docs/distributed.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
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

from ..config import Config
from .control import read_daemon_file
from .logfile import setup_logging

NODE_EXIT = re.compile(r"Node with rank (\d+) exited with code (-?\d+)")
PORTS_FROM = 40000  # where the search for N free consecutive ports starts


def launched() -> int | None:
    """This process's rank when mlx.launch started it, else None."""
    rank = os.environ.get("MLX_RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


def join(config: Config) -> tuple[Config, Any]:
    """Join the group (after the BLAS is in place: this imports mlx): the config with this rank
    and the group's size, and the Lockstep; one rank alone gets its config back and None."""
    from ..engine.lockstep import from_env

    lockstep = from_env()
    if lockstep is None:
        return config, None
    return replace(config, rank=lockstep.rank, world_size=lockstep.size), lockstep


def follow(config: Config, *, verbose: bool) -> int:
    """A follower rank's whole life: BLAS, the group, the model, then rank 0's word."""
    from ..engine.follower import serve
    from ..models.sources import ModelError, prepare_model
    from .blas import preload_blas

    config = replace(config, rank=launched() or 0)
    config.rank_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    setup_logging(verbose=verbose, log_file=config.rank_dir / "kvd.log")
    for h in _stderr_handlers():
        h.setLevel("WARNING")  # the terminal tells rank 0's story; each rank's is in its own log
    preload_blas(config.blas, threads=config.blas_threads)
    config, lockstep = join(config)
    if lockstep is None:
        print(f"kvd: error: rank {config.rank} found no group to join (is MLX_HOSTFILE set?)", file=sys.stderr)
        return 1
    durable.write_atomic(config.rank_dir / "pid", f"{os.getpid()}\n", mode=0o600)
    try:
        model_dir = prepare_model(config.model, config.models_dir)
    except ModelError as e:
        lockstep.fatal(f"the model cannot be prepared here: {e}")
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


def launch_command(argv: Sequence[str], ranks: int, port: int) -> list[str]:
    """mlx.launch running `kvd <argv>` as `ranks` local ranks on the ring backend from `port`."""
    here = Path(sys.executable).with_name("mlx.launch")
    launcher = str(here) if here.exists() else (shutil.which("mlx.launch") or "mlx.launch")
    return [launcher, "-n", str(ranks), "--backend", "ring", "--starting-port", str(port),
            "--python", sys.executable, "--", "-m", "daemon.cli", *argv]


def launch(argv: Sequence[str], config: Config, ranks: int) -> int:
    """Run `kvd <argv>` as `ranks` local ranks; 0 when every rank ended well.

    SIGINT and SIGTERM go to rank 0 alone (from daemon.json), which stops the
    followers itself after paging every cache out.
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
    began = time.time()
    proc = subprocess.Popen(launch_command(argv, ranks, free_ports(ranks)), stdin=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)

    def stop(signum: int, frame: Any) -> None:
        info = read_daemon_file(config.data_dir)
        pid = info.get("pid") if info.get("started_at", 0) >= began else None  # never an old file's pid
        try:
            if isinstance(pid, int):
                os.kill(pid, signal.SIGTERM)
            else:  # not listening yet: the whole group
                os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    failed = False
    assert proc.stderr is not None
    for line in proc.stderr:
        if (m := NODE_EXIT.search(line)) and int(m.group(2)) != 0:
            failed = True
        sys.stderr.write(line)
        sys.stderr.flush()
    return 1 if proc.wait() != 0 or failed else 0
