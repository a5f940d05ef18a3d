"""Several models share one daemon under tight budgets and kill -9: does every continuation get its cache back?

Run: .venv/bin/python bench/campaign.py [--cycles 12] [--rounds 8] [--conversations 4]
     [--models builtin:smollm2 builtin:tiny builtin:tiny-swa] [--doors ws openai] [--keep-alive 3]
     [--memory-mb 545] [--resident-mib 24] [--warm-mib 8] [--seed 1] [--log-losses] [--keep DIR]

Issue 51's red-team campaign as a bench. A real `kvd serve` (the first of
--models is its default) with three models sharing it, a model budget that
does not hold all three models' weights ([models] memory: loading one unloads
an idle other, or is refused with a 503 while the others answer), a short
keep_alive, and small resident and warm cache budgets every model's caches
count against. Each of --cycles starts kvd, runs --rounds rounds and ends with
`kill -9` at once after the last answer. In a round every conversation
(--conversations per model) takes one turn, one client thread per model, so
the models load, answer and unload beside each other (the first round of a
cycle loads them one at a time: loads at once crash kvd, issue 51's item 2);
a client idles past keep_alive now and then (--pause) so models unload and
load again; a conversation starts afresh once its prompt passes
--max-context tokens. Conversations take the two doors in turn: kvchat's
websocket (a session, `chat.send`) and the OpenAI door (the official `openai`
client, stateless: the whole conversation each time, which kvd places on the
session it continues).

Each continuation is checked against what its own cache held. Over the
websocket, the last turn's prompt and answer but the last id drawn (never
fed): the next prompt begins with exactly those ids. Through the OpenAI
door, the last turn's prompt (the answer's text, encoded again with the whole
conversation, need not give the ids drawn), for a sliding-window model only
its whole blocks (a window's state is kept where a prefill passed a block's
end, or at a turn's end, which the new encoding of the answer parts from).
After a kill -9, at most what the disk index held for the session, read
before the restart, as far as it agrees with the transcript's fed ids (a
write-behind the kill cut is no loss; the turn before's chain ends in an
answer's ids drawn, which the OpenAI door's new encoding may part from). A continuation
that restored less, or that kvd placed on another session than the one it
continues, is a loss. Printed: requests (failed: refused, or cut by a crash),
continuations checked and losses by model (each printed as it happens with
--log-losses; kvd's own log, kvd.log in --keep, has the turn's line), where the restores
came from, kvd's crashes (it died without the kill), and `uptime` before and
after (other work on the machine shows in it).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import openai  # noqa: E402

import daemonproc  # noqa: E402
from cachestore import common_prefix_len, disk_ids  # noqa: E402
from common.tokenids import unpack_tokens  # noqa: E402
from daemon.models.sources import prepare_model  # noqa: E402
from daemonproc import DaemonProcess, SyncClient  # noqa: E402

daemonproc.START_TIMEOUT = 600.0
STORE = Path(tempfile.gettempdir()) / "kvd-bench-real" / "models"  # bench/realmodel.py's store
MODELS = ("builtin:smollm2", "builtin:tiny", "builtin:tiny-swa")
MiB = 1 << 20
WORDS = ("the sea hills weather river stone light morning city road garden window story letter winter "
         "market music bridge forest field harbour tower island lamp clock paper silver summer").split()
WINDOWS = {"builtin:tiny-swa"}  # sliding-window models: a window's state is kept only where a prefill stopped
BLOCK = 128  # [cache] block_tokens (the default)


@dataclass
class Conversation:
    model: str
    name: str
    door: str  # "ws" (kvchat's websocket, a session) or "openai" (stateless, placed by kvd)
    messages: list[dict[str, str]] = field(default_factory=list)
    session: str | None = None
    turns: int = 0  # answered so far
    held: int = 0  # ids of its own cache the next turn can use (0: none yet)
    restarted: bool = False  # kvd was killed since its last turn: `held` is at most what disk held


@dataclass
class Tally:
    requests: int = 0
    failed: int = 0  # refused, or cut by a kill or a crash (sent again next round)
    continuations: collections.Counter[str] = field(default_factory=collections.Counter)
    losses: collections.Counter[str] = field(default_factory=collections.Counter)
    after_restart: collections.Counter[str] = field(default_factory=collections.Counter)
    moved: collections.Counter[str] = field(default_factory=collections.Counter)  # placed on another session
    restored_from: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    lost: list[str] = field(default_factory=list)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) + "."


def held_after(c: Conversation, usage: dict[str, Any]) -> int:
    """What of the cache a turn leaves the next turn of `c` can restore.

    Over the websocket the next turn's ids are this turn's fed ids and then the
    new message's (the fed-token rule): the cache holds them all but the last
    id drawn, which was never fed. The OpenAI door encodes the whole
    conversation again, and the answer's text need not encode to the ids drawn
    (nonsense text from a random-weight model seldom does), so what is sure is
    this turn's prompt; a window's state is kept only where a prefill stopped,
    so of that prompt its whole blocks.
    """
    prompt = int(usage["prompt_tokens"])
    if c.door == "ws":
        return prompt + int(usage["completion_tokens"]) - 1
    return prompt // BLOCK * BLOCK if c.model in WINDOWS else prompt


def send(c: Conversation, rng: random.Random, api: openai.OpenAI, ws: SyncClient | None) -> dict[str, Any]:
    """One turn's request through the conversation's door: its usage (kvd's cache figures in it), or raises."""
    max_tokens = rng.randint(4, 24)
    if c.door == "openai":
        r = api.chat.completions.create(model=c.model, messages=c.messages,  # type: ignore[arg-type]
                                        max_tokens=max_tokens, temperature=0)
        usage: Any = r.usage
        kvd = dict(usage.model_extra["kvd"])
        c.messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        return {**kvd, "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                "cached_tokens": usage.prompt_tokens_details.cached_tokens}
    if ws is None:
        raise ConnectionError("no websocket")
    if c.session is None:
        reply = ws.request("session.create", model=c.model)
        if reply["type"] != "session":
            raise RuntimeError(str(reply.get("message", reply))[:80])
        c.session = reply["session"]["id"]
    said, done = ws.chat(c.session, c.messages[-1]["content"], max_tokens=max_tokens, temperature=0)
    if done["type"] != "chat.done":
        raise RuntimeError(str(done.get("message", done))[:80])
    c.messages.append({"role": "assistant", "content": said})
    return {**done["usage"], "session": c.session}


def turn(c: Conversation, rng: random.Random, tally: Tally, args: argparse.Namespace, api: openai.OpenAI,
         ws: SyncClient | None) -> None:
    """One turn of `c`; checks what it restored against what its cache held."""
    c.messages.append({"role": "user", "content": text(rng, 20, 90)})
    before = c.session
    try:
        u = send(c, rng, api, ws)
    except Exception as e:  # a kill -9, a crash, a refusal: this turn did not happen
        c.messages.pop()
        with tally.lock:
            tally.requests += 1
            tally.failed += 1
            tally.errors[f"{c.model}: {type(e).__name__}: {str(e)[:100]}"] += 1
        return
    prompt, cached, where = int(u["prompt_tokens"]), int(u["cached_tokens"]), u.get("restored_from", "?")
    with tally.lock:
        tally.requests += 1
        tally.restored_from[c.model, where] += 1
        if c.turns:
            tally.continuations[c.model] += 1
            want = min(c.held, prompt - 1)
            if u.get("session") != before:
                tally.moved[c.model] += 1
            if u.get("session") != before or cached < want:
                tally.losses[c.model] += 1
                tally.after_restart[c.model] += c.restarted
                tally.lost.append(f"{c.model} {c.name} ({c.door}) session {before} -> {u.get('session')}: "
                                  f"restored {cached} of {want} held ({where})"
                                  f"{' after a restart' if c.restarted else ''}")
                if args.log_losses:
                    print(f"  {time.strftime('%H:%M:%S')} {tally.lost[-1]}", flush=True)
    c.session, c.held, c.restarted = u.get("session"), held_after(c, u), False
    c.turns += 1
    if prompt > args.max_context:  # long enough: a new conversation takes its place
        c.messages, c.session, c.held, c.turns = [], None, 0, 0


def client(d: DaemonProcess, convs: list[Conversation], rng: random.Random, tally: Tally,
           args: argparse.Namespace, stop: threading.Event) -> None:
    api = openai.OpenAI(base_url=d.base_url, api_key=d.token, max_retries=0, timeout=600)
    with ExitStack() as stack:
        try:
            ws: SyncClient | None = stack.enter_context(d.client())
        except Exception:
            ws = None
        for c in convs:
            if stop.is_set():
                return
            turn(c, rng, tally, args, api, ws)
            if rng.random() < args.pause:
                stop.wait(args.keep_alive + 1)  # idle past keep_alive: this model may be unloaded


def start(data: Path, config: Path, default: str) -> DaemonProcess:
    return DaemonProcess(data, "--config", str(config), "--model", default)


def after_kill(data: Path, convs: list[Conversation]) -> None:
    """What disk holds of each conversation's session once kvd died: what a continuation restores at least.

    Of the ids the session's disk chain holds, those its transcript's fed ids
    (the last turn's prompt and answer, read as kvd's next start reads them)
    begin with: a kill that cut the last turn's write-behind leaves the turn
    before's chain, whose last ids (an answer drawn, which the OpenAI door
    encodes again otherwise) the conversation may have parted from. A window's
    chain parting before its end restores at the last block's end before that
    (or a turn's end between: a bound on the safe side).
    """
    held = disk_ids(data / "cache")
    with closing(sqlite3.connect(f"file:{data / 'kvd.sqlite'}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT session_id, tokens FROM session_tokens").fetchall()
    fed = {sid: unpack_tokens(bytes(blob)) for sid, blob in rows}
    for c in convs:
        if c.session is not None:
            chain = held.get(c.session, ())
            agree = common_prefix_len(chain, fed.get(c.session, ()))
            if c.model in WINDOWS and agree < len(chain):
                agree = agree // BLOCK * BLOCK  # a window's chain parting there restores at a block's end
            c.held, c.restarted = min(c.held, agree), True


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:  # noqa: C901 - the campaign's one loop, read top to bottom
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--cycles", type=int, default=12, help="daemon lives, each ended by kill -9")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per cycle (a turn of every conversation)")
    ap.add_argument("--conversations", type=int, default=4, help="conversations per model")
    ap.add_argument("--doors", nargs="+", choices=("ws", "openai"), default=["ws", "openai"],
                    help="the doors the conversations take, in turn")
    ap.add_argument("--max-context", type=int, default=1200, help="prompt tokens past which a conversation restarts")
    ap.add_argument("--keep-alive", type=float, default=3.0)
    ap.add_argument("--memory-mb", type=int, default=545, help="[models] memory, in MB")
    ap.add_argument("--resident-mib", type=int, default=24)
    ap.add_argument("--warm-mib", type=int, default=8)
    ap.add_argument("--pause", type=float, default=0.1, help="chance a client idles past keep_alive after a turn")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--log-losses", action="store_true", help="print each loss as it happens")
    ap.add_argument("--keep", type=Path, help="keep the data directory here (a fresh one; else a temporary one)")
    args = ap.parse_args()
    print("before:", uptime(), flush=True)
    for model in args.models:
        prepare_model(model, STORE)  # fetched and converted once, kept across runs
    rng = random.Random(args.seed)
    convs = [Conversation(m, f"{m.split(':')[-1]}#{i}", args.doors[i % len(args.doors)])
             for m in args.models for i in range(args.conversations)]
    tally = Tally()
    crashes = 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvd-bench-campaign-") as tmp:
        data = args.keep if args.keep is not None else Path(tmp) / "kvd"
        shutil.copytree(STORE, data / "models", copy_function=os.link)
        config = Path(tmp) / "kvd.toml"
        config.write_text(f"[models]\nkeep_alive = {args.keep_alive}\nmemory = {args.memory_mb * 1000 * 1000}\n"
                          f"[cache]\nresident_bytes = {args.resident_mib * MiB}\nwarm_bytes = {args.warm_mib * MiB}\n")
        for cycle in range(args.cycles):
            d = start(data, config, args.models[0])
            stop = threading.Event()
            for r in range(args.rounds):
                threads = [threading.Thread(target=client, args=(d, [c for c in convs if c.model == m],
                                                                  random.Random(rng.random()), tally, args, stop))
                           for m in args.models]
                for th in threads:  # the first round one model at a time: concurrent loads crash kvd (issue 51)
                    th.start()
                    if r == 0:
                        th.join()
                for th in threads:
                    th.join()
                if d.proc.poll() is not None:
                    break
            died = d.proc.poll() is not None
            if died:
                crashes += 1
                print(f"cycle {cycle + 1}: kvd died by itself ({d.proc.returncode}): "
                      f"{''.join(d.log[-3:]).strip()}", flush=True)
            else:
                os.kill(d.proc.pid, signal.SIGKILL)  # at once after the last answer: write-behinds may be cut
            d.proc.wait()
            after_kill(data, convs)
            print(f"cycle {cycle + 1}: {tally.requests} requests, {sum(tally.losses.values())} losses, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
        print(f"\nafter: {uptime()}")
        print(f"{args.cycles} cycles, {tally.requests} requests ({tally.failed} failed), "
              f"{time.perf_counter() - t0:.0f} s, {crashes} crash(es)")
        print("| model | continuations | restored less than held | of those after a restart | placed elsewhere |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for m in args.models:
            print(f"| {m} | {tally.continuations[m]} | {tally.losses[m]} | {tally.after_restart[m]} | "
                  f"{tally.moved[m]} |")
        print("restored from:", ", ".join(f"{m.split(':')[-1]} {w}: {n}"
                                          for (m, w), n in sorted(tally.restored_from.items())))
        for e, n in tally.errors.most_common(8):
            print(f"  failed x{n}: {e}")
    return 1 if sum(tally.losses.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
