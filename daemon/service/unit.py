"""`kvd service install`: run `kvd serve` at login under systemd (Linux) or launchd (macOS).

The unit files are built by pure functions (tested for their content); only
`install` touches the disk. The service runs `kvd serve` in the foreground
(no --detach: the service manager is the one that keeps it running), with
the data directory spelled out so the daemon and `kvd status` agree on it.
"""

from __future__ import annotations

import os
import plistlib
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from common import durable

SYSTEMD_UNIT = "kvd.service"
LAUNCHD_LABEL = "dev.kvd.daemon"


@dataclass(frozen=True)
class ServiceFile:
    path: Path
    content: str
    next_steps: list[str]  # the commands that start it, for the user to run


def serve_command(data_dir: Path, config: Path | None) -> list[str]:
    """The argv that runs this installation's `kvd serve` for `data_dir`."""
    script = Path(sys.executable).parent / "kvd"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "daemon.cli"]
    argv += ["serve", "--data-dir", str(data_dir)]
    if config is not None:
        argv += ["--config", str(config.resolve())]
    return argv


def systemd_unit(argv: list[str]) -> str:
    """A systemd user unit: restarted on failure, owner-only files, stopped with SIGTERM."""
    return "\n".join([
        "[Unit]",
        "Description=kvd: local chat daemon with per-conversation KV caches",
        "After=network.target",
        "",
        "[Service]",
        "Type=simple",
        f"ExecStart={shlex.join(argv)}",
        "Restart=on-failure",
        "RestartSec=5",
        # kvd pages every cache out on SIGTERM before it exits; give it time.
        "TimeoutStopSec=120",
        "UMask=0077",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ])


def launchd_plist(argv: list[str], log_file: Path) -> str:
    """A launchd agent: started at login, restarted if it exits with an error."""
    return plistlib.dumps({
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": argv,
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ExitTimeOut": 120,
        "Umask": 0o077,
        "StandardErrorPath": str(log_file.with_name(log_file.name + ".stderr")),
        "ProcessType": "Background",
    }).decode()


def service_file(data_dir: Path, log_file: Path, config: Path | None, *,
                 platform: str = sys.platform, home: Path | None = None) -> ServiceFile:
    argv = serve_command(data_dir, config)
    home = home or Path.home()
    if platform == "darwin":
        path = home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
        return ServiceFile(path, launchd_plist(argv, log_file),
                           [f"launchctl bootstrap gui/{os.getuid()} {path}"])
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
    path = config_home / "systemd" / "user" / SYSTEMD_UNIT
    return ServiceFile(path, systemd_unit(argv),
                       ["systemctl --user daemon-reload", f"systemctl --user enable --now {SYSTEMD_UNIT}"])


def install(sf: ServiceFile) -> None:
    sf.path.parent.mkdir(parents=True, exist_ok=True)
    durable.write_atomic(sf.path, sf.content)
