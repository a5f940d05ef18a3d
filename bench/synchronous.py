"""What `PRAGMA synchronous = FULL` costs the transcript per chat turn, against NORMAL and kvd's mix.

Run: .venv/bin/python bench/synchronous.py [--turns 200] [--dir /path/on/the/disk/to/measure]

One turn is the store calls the daemon makes for it (daemon/server.py): the
user's message appended, the assistant's placeholder appended, the answer
committed while it streams (one commit per COMMIT_INTERVAL; --updates of
them), then finalized with its fed token ids. The same turns run against a
real kvd.sqlite in WAL mode with each setting; it prints the median and p90
milliseconds per turn. In WAL mode NORMAL fsyncs only at checkpoints (a
commit survives a killed process, not a power cut); FULL fsyncs the WAL at
every commit (a commit survives a power cut).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sessions import Store  # noqa: E402


def turn_ms(store: Store, sid: str, updates: int, history: list[int]) -> float:
    t0 = time.perf_counter()
    first = store.append_message(sid, "user", "A question of about this length, asked by a person. " * 3)
    index = store.append_message(sid, "assistant", "", status="streaming")
    text = ""
    for _ in range(updates):
        text += "some streamed words of an answer, " * 4
        store.update_message(sid, index, content=text)
    history.extend(range(len(history), len(history) + 200))
    store.update_message(sid, index, content=text, status="complete", finish_reason="stop",
                         usage={"prompt_tokens": len(history)}, fed_end=len(history))
    store.set_tokens(sid, history, covers=index + 1)
    assert first == index - 1
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--updates", type=int, default=8, help="streaming commits per answer")
    ap.add_argument("--dir", type=Path, default=None, help="a directory on the disk to measure")
    args = ap.parse_args()
    # NORMAL: every commit unsynced. FULL: every commit fsynced. kvd: what the store
    # does (FULL, but streamed chunks NORMAL). Twice each, interleaved: load drifts.
    for mode in ("NORMAL", "FULL", "kvd", "NORMAL", "FULL", "kvd"):
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            store = Store(Path(tmp) / "kvd.sqlite")
            if mode != "kvd":
                store.synchronous = store.streamed_synchronous = mode
                store.db.execute(f"PRAGMA synchronous = {mode}")
            sid = store.create_session(title="New chat")["id"]
            history: list[int] = []
            times = [turn_ms(store, sid, args.updates, history) for _ in range(args.turns)]
            store.close()
        q = statistics.quantiles(times, n=10)
        print(f"synchronous={mode:6s} turns={args.turns} commits/turn={args.updates + 4}: "
              f"median {statistics.median(times):.2f} ms, p90 {q[-1]:.2f} ms per turn")


if __name__ == "__main__":
    main()
