"""How long one client's ping waits while another floods kvd with requests.

Run: .venv/bin/python bench/fairness.py [--sessions 200] [--flood 300] [--unfair]

An in-process daemon (builtin:tiny, port 0) with --sessions stored sessions;
client A sends --flood `session.list` requests in one burst, client B then
sends a ping and times its pong. --unfair turns the per-request yield in
daemon/doors/connection.py off, which is how kvd behaved before it: B waits for A's
whole burst.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


from conftest import client, running_daemon  # noqa: E402


async def run(sessions: int, flood: int) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        async with running_daemon(Path(tmp), model="builtin:tiny") as d:
            async with client(d) as setup:
                for _ in range(sessions):
                    await setup.request("session.create")
            async with client(d) as a, client(d) as b:
                for i in range(flood):
                    await a.send({"id": i, "type": "session.list"})
                t0 = time.perf_counter()
                await b.send({"id": "p", "type": "ping"})
                while (await b.recv())["id"] != "p":
                    pass
                rtt = time.perf_counter() - t0
                handled = max(c.handled for c in d.daemon.connection_statistics())
                for _ in range(flood):
                    await a.recv()
                return rtt, handled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--flood", type=int, default=300)
    ap.add_argument("--unfair", action="store_true")
    args = ap.parse_args()
    if args.unfair:
        import anyio.lowlevel

        async def no_yield() -> None:
            return None

        anyio.lowlevel.checkpoint = no_yield  # what daemon.connection calls after each request
    rtt, handled = anyio.run(run, args.sessions, args.flood)
    print(json.dumps({"fair": not args.unfair, "sessions": args.sessions, "flood": args.flood,
                      "ping_ms": round(rtt * 1000, 1), "flood_requests_done_at_pong": handled}))


if __name__ == "__main__":
    main()
