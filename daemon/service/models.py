"""`kvd models`, `kvd models pull` and `kvd ps`: the models kvd can serve, one fetched now, the ones loaded.

`kvd models` lists what is on this machine (daemon/models/catalog.py) with the
running daemon's word on which are loaded; `kvd ps` asks the running daemon
for its loaded models (its status's "models", daemon/engine/registry.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import protocol as p

if TYPE_CHECKING:  # Rich and websockets load with the command that needs them, not with every `kvd`
    from rich.console import Console

Subparsers = Any  # argparse's _SubParsersAction


def add_commands(sub: Subparsers) -> None:
    """`kvd models [pull NAME]` and `kvd ps` on kvd's command line (daemon/cli.py)."""
    md = sub.add_parser("models", help="list the models kvd can find here (built-in, its store, Ollama, "
                        "the Hugging Face cache), whether each runs, its context length and whether the running "
                        "daemon has it loaded; `kvd models pull NAME` fetches one")
    md.set_defaults(func=_models_command, parser=md)
    md.add_argument("action", nargs="?", choices=["pull"], help="pull: fetch (and convert) NAME now, not on first use")
    md.add_argument("name", nargs="?", help="the model to pull: a built-in, a Hugging Face repo id, a .gguf file")
    md.add_argument("--data-dir", type=Path, help="the data directory whose model store to list")
    ps = sub.add_parser("ps", help="the models the running daemon has loaded: memory, idle time, when each unloads")
    ps.set_defaults(func=_ps_command, parser=ps)
    ps.add_argument("--data-dir", type=Path, help="the daemon's data directory")
    ps.add_argument("--url", help="the daemon's URL (default: from the data directory)")
    ps.add_argument("--json", action="store_true", help="print the loaded models as JSON")


def _data_dir(args: argparse.Namespace) -> Path:
    return args.data_dir or p.default_data_dir()


def _models_command(args: argparse.Namespace, argv: list[str]) -> int:
    if args.action == "pull":
        if not args.name:
            args.parser.error("kvd models pull needs a NAME (kvd models lists them)")
        return pull_main(args.name, _data_dir(args))
    if args.name is not None:
        args.parser.error(f"unrecognized arguments: {args.name} (to fetch a model: kvd models pull NAME)")
    return list_main(_data_dir(args))


def _ps_command(args: argparse.Namespace, argv: list[str]) -> int:
    return ps_main(_data_dir(args), args.url, args.json)


def list_main(data_dir: Path) -> int:
    """`kvd models`: one line per model, with whether the running daemon has it loaded."""
    from ..models.catalog import entries, render

    for line in render(list(entries(data_dir / "models")), loaded=loaded_models(data_dir)):
        print(line)
    return 0


def pull_main(name: str, data_dir: Path) -> int:
    """`kvd models pull NAME`: fetch and convert it now (what a first use would do), or say in one line why not."""
    from ..models.sources import ModelError, prepare_model, progress_bar

    try:
        with progress_bar() as progress:
            path = prepare_model(name, data_dir / "models", progress=progress)
    except ModelError as e:
        print(f"kvd models pull: {e}", file=sys.stderr)
        return 1
    print(f"kvd: {name} is ready in {path}; a request that names it loads it")
    return 0


def render_ps(models: list[dict[str, Any]], console: Console) -> None:
    """`kvd ps`: each loaded model, its weights' memory, its context length, how long it has been idle."""
    from rich.table import Table

    from .status import duration, human
    table = Table(show_edge=False)
    for col in ("model", "state", "memory", "context", "idle", "unloads in"):
        table.add_column(col, justify="left" if col in ("model", "state") else "right")
    for m in models:
        idle, until = m.get("idle_s"), m.get("unloads_in_s")
        table.add_row(m["model"] + (" (default)" if m.get("default") else ""), m["state"],
                      human(m["weights_bytes"]) if m.get("weights_bytes") else "-",
                      str(m["context_length"]) if m.get("context_length") else "-",
                      duration(idle) if idle is not None else "-",
                      duration(until) if until is not None else "-")
    console.print(table)


def loaded_models(data_dir: Path, timeout: float = 2.0) -> dict[str, str] | None:
    """The running daemon's models and their states (`kvd models`'s "loaded" column); None: no daemon answers."""
    from websockets.exceptions import WebSocketException

    from .status import fetch_status

    url = p.read_daemon_url(data_dir)
    if url is None:
        return None
    try:
        status = fetch_status(url, (data_dir / p.TOKEN_FILE).read_text().strip(), timeout)
    except (OSError, RuntimeError, WebSocketException):
        return None
    return {m["model"]: m["state"] for m in status.get("models") or []}


def ps_main(data_dir: Path, url: str | None, as_json: bool) -> int:
    """`kvd ps`: the loaded models of the daemon in `data_dir` (or at `url`)."""
    from rich.console import Console
    from websockets.exceptions import WebSocketException

    from .status import fetch_status, gone

    url = url or p.read_daemon_url(data_dir)
    if url is None:
        return gone(data_dir, f"no running daemon found in {data_dir}")
    try:
        status = fetch_status(url, (data_dir / p.TOKEN_FILE).read_text().strip())
    except OSError as e:
        return gone(data_dir, f"cannot reach kvd at {url}: {e}")
    except (RuntimeError, WebSocketException) as e:
        print(f"kvd ps: {e}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(status.get("models") or [], indent=2))
    else:
        render_ps(status.get("models") or [], Console(width=max(Console().width, 100)))
    return 0


