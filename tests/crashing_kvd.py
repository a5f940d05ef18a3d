"""`kvd` with a crash point set: ``python tests/crashing_kvd.py POINT serve …`` runs `kvd serve …`
and dies like kill -9 when the cache writer reaches POINT (cachestore/writeback.py's crash_hook), or
the transcript's writer a point "transcript:..." (sessions/writer.py's crash_hook).

The daemon itself never reads a crash point from its environment: the hook is set here, in the
process the test starts, before kvd's own main runs.
"""

from __future__ import annotations

import os
import sys

from cachestore import writeback
from daemon.cli import main
from sessions import writer


def crash_at(wanted: str) -> None:
    def hook(point: str) -> None:
        if point == wanted:
            os.kill(os.getpid(), 9)

    if wanted.startswith("transcript:"):
        writer.crash_hook = hook
    else:
        writeback.crash_hook = hook


if __name__ == "__main__":
    crash_at(sys.argv[1])
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    sys.exit(main())
