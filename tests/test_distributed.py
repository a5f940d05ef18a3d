"""kvd across two ranks (ring backend on loopback, builtin:tiny split in two): real processes.

Every answer here is greedy and compared with one rank's: the split model, the
lockstep, the per-rank cache shares and their common-prefix checkout must
change nothing a client can see.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from daemonproc import DaemonProcess

TURNS = ["Hello there, tell me a story about a river that runs from the mountains to the sea, past a town "
         "with a mill, a bridge and a market, where people sell fish, bread and apples every morning.",
         "And another one, about a mountain.", "A third turn, after a restart, with rank 1's share damaged."]
ASK = [{"role": "user", "content": "Name three colours of the sea."}]
N = 24  # tokens per answer


def ranks2(data_dir: Path, **env: str) -> DaemonProcess:
    return DaemonProcess(data_dir, "--ranks", "2", env=env)


def turn(d: DaemonProcess, sid: str, text: str) -> tuple[str, dict[str, Any]]:
    with d.client() as c:
        out, done = c.chat(sid, text, max_tokens=N, temperature=0)
    assert done["type"] == "chat.done", done
    return out, done["usage"]


def ask_openai(d: DaemonProcess) -> list[str]:
    """A greedy answer; one held to JSON by the grammar, and one sampled with a seed: every rank
    must mask and draw alike, or the ranks would feed different tokens."""
    client = openai.OpenAI(base_url=d.base_url, api_key=d.token, max_retries=0)
    plain = client.chat.completions.create(model="builtin:tiny", messages=ASK,  # type: ignore[arg-type]
                                           max_tokens=N, temperature=0)
    held = client.chat.completions.create(model="builtin:tiny", messages=ASK,  # type: ignore[call-overload]
                                          max_tokens=N, temperature=0, response_format={"type": "json_object"})
    drawn = client.chat.completions.create(model="builtin:tiny", messages=ASK,  # type: ignore[arg-type]
                                           max_tokens=N, temperature=0.9, seed=7)
    return [r.choices[0].message.content or "" for r in (plain, held, drawn)]


def fed(data_dir: Path, sid: str, rank: int) -> int:
    """How many of the session's ids this rank's share on disk holds (its last segment's end)."""
    segments = (data_dir / f"rank-{rank}" / "cache" / "segments" / sid).rglob("*.safetensors")
    return max((int(p.stem.split("-")[1]) for p in segments), default=0)


def ask_kvchat(d: DaemonProcess) -> str:
    """kvchat's one-shot mode (`kvchat "question" --json`), as a script would run it."""
    r = subprocess.run([str(Path(sys.executable).with_name("kvchat")), ASK[0]["content"], "--data-dir",
                        str(d.data_dir), "--max-tokens", str(N), "--temperature", "0", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["answer"])


def new_session(d: DaemonProcess) -> str:
    with d.client() as c:
        return str(c.request("session.create")["session"]["id"])


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One rank's greedy answers to every turn of one session, and to the OpenAI request."""
    d = DaemonProcess(tmp_path_factory.mktemp("one-rank"))
    try:
        sid = new_session(d)
        return {"turns": [turn(d, sid, t)[0] for t in TURNS], "openai": ask_openai(d), "kvchat": ask_kvchat(d)}
    finally:
        assert d.terminate() == 0


def test_two_ranks_answer_as_one_over_websocket_openai_and_kvchat(tmp_path: Path, one_rank: dict[str, Any]) -> None:
    d = ranks2(tmp_path)
    try:
        sid = new_session(d)
        first, _ = turn(d, sid, TURNS[0])
        second, usage = turn(d, sid, TURNS[1])
        api = ask_openai(d)
        with pytest.raises(openai.BadRequestError, match="sharded across ranks"):  # n > 1: rank 0 alone would fork
            openai.OpenAI(base_url=d.base_url, api_key=d.token, max_retries=0).chat.completions.create(
                model="builtin:tiny", messages=ASK, max_tokens=N, n=2)  # type: ignore[arg-type]
        kvchat = ask_kvchat(d)
        with d.client() as c:
            ranks = c.request("status")["ranks"]
    finally:
        assert d.terminate() == 0
    assert [first, second] == one_rank["turns"][:2]
    assert usage["restored_from"] == "resident" and usage["drafted_tokens"] == 0  # no speculation on 2 ranks
    assert api == one_rank["openai"] and all(api)
    assert kvchat == one_rank["kvchat"] and kvchat
    # Rank 0's side of the control channel: a 64-byte header per message, and few of them.
    assert ranks["world_size"] == 2 and ranks["bytes"] >= 64 * ranks["messages"] > 0
    log = "".join(d.log)
    assert "rank 0 of 2" in log and "Traceback" not in log
    for r in (0, 1):  # each rank kept its own share, under its own directory
        assert list((tmp_path / f"rank-{r}" / "cache" / "segments" / sid).rglob("*.safetensors"))
    assert not (tmp_path / "cache" / "segments").exists()


def test_restart_resumes_from_disk_and_a_damaged_share_falls_back_exactly(
        tmp_path: Path, one_rank: dict[str, Any]) -> None:
    d = ranks2(tmp_path)
    try:
        sid = new_session(d)
        turn(d, sid, TURNS[0])
        turn(d, sid, TURNS[1])
    finally:
        assert d.terminate() == 0  # pages every rank's share out to disk
    # Each rank holds the session as 128-token blocks and a tail segment. Rank 1's tail is damaged;
    # rank 0's is whole. Both restore what both hold: rank 0 rewinds its share to rank 1's.
    held = fed(tmp_path, sid, 0)
    tail = max((tmp_path / "rank-1" / "cache" / "segments" / sid).rglob("*.safetensors"))
    common = int(tail.stem.split("-")[0])
    assert 0 < common < held == fed(tmp_path, sid, 1)
    data = bytearray(tail.read_bytes())
    data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
    tail.write_bytes(bytes(data))

    d = ranks2(tmp_path)
    try:
        third, u = turn(d, sid, TURNS[2])
    finally:
        assert d.terminate() == 0
    assert third == one_rank["turns"][2]  # exact, as one rank that never restarted
    assert u["restored_from"] == "disk" and u["restored_tokens"] == common
    assert u["prefill_tokens"] == u["prompt_tokens"] - common
    assert f"rank 0 held {held} token(s), every rank {common}" in (tmp_path / "kvd.log").read_text()


def test_kill_9_of_rank_1_ends_rank_0_with_one_line_and_a_restart_resumes(
        tmp_path: Path, one_rank: dict[str, Any]) -> None:
    # A rank killed mid-answer: rank 0's collective fails ("connection to a peer was lost") or
    # never ends, and the watchdog ends it (its idle heartbeat is a third of the timeout).
    d = ranks2(tmp_path)
    try:
        sid = new_session(d)
        first, u1 = turn(d, sid, TURNS[0])
    finally:
        assert d.terminate() == 0  # every rank's share on disk
    assert first == one_rank["turns"][0]
    fed_one = fed(tmp_path, sid, 0)
    assert fed_one == fed(tmp_path, sid, 1) >= u1["prompt_tokens"]

    d = ranks2(tmp_path, KVD_RANK_TIMEOUT="6")
    try:
        with d.client() as c:
            c.send(type="chat.send", session=sid, text="Now a long answer, please.", max_tokens=2000,
                   temperature=0)
            deltas = 0
            while deltas < 5:
                deltas += c.recv()["type"] == "chat.delta"
            os.kill(int((tmp_path / "rank-1" / "pid").read_text()), signal.SIGKILL)
            assert d.proc.wait(timeout=60) == 1
    finally:
        if d.proc.poll() is None:  # the test failed before the group ended: leave nothing running
            d.terminate()
    kvd_lines = [line for line in d.log if line.startswith("kvd: ")]
    lost = [line for line in kvd_lines if "rank 1" in line and "lost" in line]
    assert len(lost) == 1 and lost[0].startswith("kvd: error: rank 0: lost rank 1 ("), d.log
    assert "Traceback" not in "".join(d.log)

    d = ranks2(tmp_path)
    try:
        with d.client() as c:
            got = c.request("session.get", session=sid)
        assert [m["status"] for m in got["messages"]][-1] == "error"  # the cut-off answer, kept
        _, u = turn(d, sid, "Still there?")
    finally:
        assert d.terminate() == 0
    assert u["restored_from"] == "disk"
    assert u["restored_tokens"] == fed_one


def test_a_model_whose_heads_do_not_divide_is_refused_with_one_line(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "daemon.cli", "serve", "--ranks", "3", "--model", "builtin:tiny",
                        "--port", "0", "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if line.startswith("kvd: error")]
    assert len(lines) == 1 and re.search(r"4 attention heads and 2 KV heads, which do not divide by 3 "
                                         r"ranks; run it on 1 or 2 rank", lines[0]), r.stderr
    assert not (tmp_path / "rank-0").exists()


def test_a_bad_rank_timeout_stops_the_ranks_with_one_line_and_one_rank_ignores_it(tmp_path: Path) -> None:
    env = {**os.environ, "KVD_RANK_TIMEOUT": "soon"}
    r = subprocess.run([sys.executable, "-m", "daemon.cli", "serve", "--ranks", "2", "--model", "builtin:tiny",
                        "--port", "0", "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
                       env=env)
    assert (r.returncode, r.stderr) == (2, "kvd: error: KVD_RANK_TIMEOUT must be a number of seconds above 0, "
                                           "not 'soon'\n")
    d = DaemonProcess(tmp_path / "one", env={"KVD_RANK_TIMEOUT": "soon"})  # the variable is only for ranks
    try:
        with d.client() as c:
            assert c.request("session.list")["sessions"] == []
    finally:
        assert d.terminate() == 0
