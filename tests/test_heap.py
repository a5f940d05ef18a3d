"""malloc tuned so a forward's buffers are pages already touched (daemon/engine/heap.py), in real processes.

Each case runs in a fresh Python process (tuning malloc is for a whole process, and must come before
its threads), allocating MLX arrays the way a turn's attention does: buffers of ~1.5 MB, freed, then
a few KB larger the next time (MLX's own cache reuses a buffer only for nearly its size).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from daemon.engine import heap

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, resource, sys
from daemon.engine import heap
line = heap.tune(int(sys.argv[1]))
touched = heap.reserve()
import mlx.core as mx

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def turn(extra):
    # 48 buffers of ~1.5 MB alive at once (a layer's attention blocks at a long cache), then freed.
    f0 = faults()
    arrays = [mx.full((393216 + extra,), 1.0) for _ in range(48)]
    mx.eval(arrays)
    del arrays
    return faults() - f0

print(json.dumps({"line": line, "touched": touched, "first": turn(0), "next": turn(4096)}))
"""


def run(keep: int, env: dict[str, str] | None = None) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(keep)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, **(env or {})}, check=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_a_first_and_a_next_turn_find_touched_pages() -> None:
    """Tuned and reserved: a fresh process's first 72 MB of buffers, and the next turn's slightly larger
    ones, fault in almost nothing; as the C library keeps it, both fault in most of their pages."""
    pages = 48 * 393216 * 4 // 4096  # 18,432 pages a turn
    tuned = run(256 << 20)
    assert tuned["line"] == "heap: 256 MiB of freed memory kept for the next forward"
    assert tuned["touched"] == 256 << 20
    assert isinstance(tuned["first"], int) and tuned["first"] < pages // 10, tuned
    assert isinstance(tuned["next"], int) and tuned["next"] < pages // 10, tuned
    plain = run(256 << 20, env={heap.ENV_VAR: "off"})
    assert plain["line"] == "heap: as the C library keeps it (KVD_HEAP=off)" and plain["touched"] == 0
    assert isinstance(plain["first"], int) and plain["first"] > pages // 2, plain
    assert isinstance(plain["next"], int) and plain["next"] > pages // 2, plain


def test_nothing_is_tuned_where_the_policy_keeps_nothing() -> None:
    """A GPU's policy keeps 0: malloc is left alone and there is no reserve to touch."""
    assert heap.tune(0) == "heap: as the C library keeps it"
    assert heap.tuned() == 0 and heap.reserve() == 0
