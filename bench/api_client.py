"""The OpenAI door's time to first token as kvd gives it: a plain HTTP client beside the official one's own cost.

Run: .venv/bin/python bench/api_client.py [--turns 214]

bench/overhead.py's OpenAI figures are the official `openai` client's, which
prepares each request in Python (`maybe_transform` over every message): on
a 2-core CPU that alone is ~2.5 ms for 10 messages and ~58 ms for 400, and
it grows with the conversation whatever the server does. This bench runs
the same conversation (a ~700-token first message, then one short message
and a one-token answer per turn, back to back) with a plain client instead:
`json.dumps` of the whole conversation and an httpx stream, which is all
any client must do. Reported per window of 15 turns (around turn 5 and
turn 200): the client's TTFT; kvd's `ttft_ms` (from the turn core starting
the turn: the tokenizer stage, the engine's queue, restore and prefill);
their difference (HTTP, the body's parsing, placement, the first chunk);
and the official client's own preparation of a request of that size,
measured with no server (httpx's MockTransport).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402
import httpx2  # noqa: E402
import openai  # noqa: E402

from daemonproc import DaemonProcess  # noqa: E402
from overhead import FIRST  # noqa: E402  (the same ~700-token first message: bench/ is on the path)

WINDOW = 15
MODEL = "builtin:tiny"


def turns(d: DaemonProcess, n: int) -> tuple[list[float], list[float]]:
    """The client's TTFT and kvd's ttft_ms (seconds) of each of `n` turns after an untimed first one."""
    url = d.base_url.rstrip("/") + "/chat/completions"
    client = httpx.Client(headers={"Authorization": f"Bearer {d.token}"}, timeout=60)
    messages: list[dict[str, Any]] = [{"role": "user", "content": FIRST}]
    messages.append({"role": "assistant", "content": _turn(client, url, messages)[2]})
    ttfts: list[float] = []
    kvd: list[float] = []
    for i in range(n):
        messages.append({"role": "user", "content": f"next {i}"})
        ttft, engine, text = _turn(client, url, messages)
        messages.append({"role": "assistant", "content": text})
        ttfts.append(ttft)
        kvd.append(engine)
    client.close()
    return ttfts, kvd


def _turn(client: httpx.Client, url: str, messages: list[dict[str, Any]]) -> tuple[float, float, str]:
    started = time.perf_counter()
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    first: float | None = None
    engine = 0.0
    text = ""
    with client.stream("POST", url, content=body, headers={"Content-Type": "application/json"}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("kvd"):
                engine = (chunk["kvd"].get("ttft_ms") or 0) / 1000
            if chunk.get("choices") and (delta := chunk["choices"][0]["delta"].get("content")):
                first = first if first is not None else time.perf_counter() - started
                text += delta
    return (first if first is not None else time.perf_counter() - started), engine, text


def official_client_cost(messages: int, runs: int = 15) -> float:
    """Median seconds the official client spends on one streaming request of `messages` messages, no server."""
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}, "finish_reason": None}]}
    sse = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
    transport = httpx2.MockTransport(lambda request: httpx2.Response(  # the openai client's own httpx
        200, content=sse, headers={"content-type": "text/event-stream"}))
    client = openai.OpenAI(base_url="http://kvd.invalid/v1", api_key="none", max_retries=0,
                           http_client=openai.DefaultHttpxClient(transport=transport))
    convo: list[Any] = [{"role": "user", "content": FIRST}]
    convo += [{"role": "assistant" if i % 2 == 0 else "user", "content": f"next {i}"} for i in range(messages - 1)]
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        for _chunk in client.chat.completions.create(model=MODEL, messages=convo, max_tokens=1, temperature=0,
                                                     stream=True):
            pass
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def report(name: str, xs: list[float], at: tuple[int, ...]) -> None:
    medians = {}
    for n in at:
        ms = sorted(x * 1000 for x in xs[n - 1:n - 1 + WINDOW])
        medians[n] = statistics.median(ms)
        print(f"{name:16} turns {n:3}-{n + len(ms) - 1:3}: median {medians[n]:6.1f} ms "
              f"(range {ms[0]:.1f}-{ms[-1]:.1f})")
    if len(at) > 1:
        print(f"{name:16} turn {at[-1]} / turn {at[0]}: {medians[at[-1]] / medians[at[0]]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=214, help="timed turns (>= 214 for the turn-200 window)")
    args = ap.parse_args()
    at = (5, 200) if args.turns >= 200 + WINDOW - 1 else (5,)
    print(f"load before: {os.getloadavg()[0]:.2f} (1-minute average), {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "kvd"
        data.mkdir()
        d = DaemonProcess(data)
        try:
            with d.client():
                pass  # the model has loaded
            ttfts, kvd = turns(d, args.turns)
        finally:
            d.terminate()
    report("plain client", ttfts, at)
    report("kvd ttft_ms", kvd, at)
    report("outside ttft_ms", [c - k for c, k in zip(ttfts, kvd, strict=True)], at)
    for n in at:  # turn n sends 2n + 1 messages
        print(f"the official client's own preparation at turn {n:3} ({2 * n + 1} messages): "
              f"{official_client_cost(2 * n + 1) * 1000:.1f} ms")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
