"""A real `kvd serve` process: stop and start, kill -9 mid-stream and mid page-out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cachestore.index import SegmentIndex
from daemonproc import DaemonProcess


def test_stop_start_resume_restores_from_disk(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    with d.client() as c:
        sid = c.request("session.create")["session"]["id"]
        _, first = c.chat(sid, "Hello, this is a conversation to remember.", max_tokens=20, temperature=0)
        _, second = c.chat(sid, "And a second turn.", max_tokens=20, temperature=0)
    assert d.terminate() == 0
    assert not (tmp_path / "daemon.json").exists()
    assert "stopped" in "".join(d.log)

    d = DaemonProcess(tmp_path)
    try:
        with d.client() as c:
            got = c.request("session.get", session=sid)
            assert [m["status"] for m in got["messages"]] == ["complete"] * 4
            _, done = c.chat(sid, "After the restart?", max_tokens=10, temperature=0)
    finally:
        d.terminate()
    u, before = done["usage"], second["usage"]
    assert u["restored_from"] == "disk"
    # Only the new message is prefilled: everything fed before the restart was restored.
    assert u["restored_tokens"] == before["prompt_tokens"] + before["completion_tokens"]
    assert u["prefill_tokens"] == u["prompt_tokens"] - u["restored_tokens"]


LONG = "1 2 3 4 5 6 7 8 9 10 11 12"


def test_kill_9_mid_stream_keeps_transcript_and_resumes(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    with d.client() as c:
        sid = c.request("session.create")["session"]["id"]
        _, first = c.chat(sid, "A first turn that completes.", max_tokens=20, temperature=0)
        # A status is answered once the writes queued before it are done: turn one's cache is on disk
        # before the kill (its write-behind otherwise races the second turn's 20 deltas, and lost under load).
        c.request("status")
        # builtin:tiny's greedy answer to this runs to max_tokens (155 deltas for 1,500 tokens here). A delta
        # carries up to 20 ms of tokens, so "Now a long answer, please." (99 tokens) ended in 11.
        c.send(type="chat.send", session=sid, text=LONG, max_tokens=4000, temperature=0)
        streamed: list[str] = []
        while len(streamed) < 20:
            event = c.recv()
            assert event["type"] not in ("chat.done", "error"), event  # the answer has not ended
            if event["type"] == "chat.delta":
                streamed.append(event["text"])
        d.kill()

    d = DaemonProcess(tmp_path)
    try:
        with d.client() as c:
            got = c.request("session.get", session=sid)
            roles = [(m["role"], m["status"]) for m in got["messages"]]
            assert roles == [("user", "complete"), ("assistant", "complete"),
                             ("user", "complete"), ("assistant", "error")]
            assert got["messages"][2]["content"] == LONG
            # The part that streamed was committed as it streamed (at least its first delta).
            partial = got["messages"][3]["content"]
            assert partial and "".join(streamed).startswith(partial)
            _, done = c.chat(sid, "Still there?", max_tokens=8, temperature=0)
    finally:
        d.terminate()
    assert done["type"] == "chat.done"
    u = done["usage"]
    # What reached disk (turn one) is restored; the cut-off turn and the new one are prefilled.
    assert u["restored_from"] == "disk"
    assert u["restored_tokens"] == first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]


def test_kill_9_mid_page_out_never_references_a_partial_file(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, crash_at="after-write")
    with d.client() as c:
        sid = c.request("session.create")["session"]["id"]
        c.send(type="chat.send", session=sid, text="This turn dies while its cache is paged out.",
               max_tokens=12, temperature=0)
        try:
            while c.recv()["type"] != "chat.done":
                pass
        except Exception:
            pass  # the daemon may die before or after the answer reaches us
    assert d.proc.wait(timeout=60) == -9
    orphans = [p for p in (tmp_path / "cache" / "segments").rglob("*") if p.is_file()]
    assert orphans  # the file was written but never indexed

    d = DaemonProcess(tmp_path)
    try:
        with d.client() as c:
            got = c.request("session.get", session=sid)
            assert got["messages"][0]["content"].startswith("This turn dies")
            _, done = c.chat(sid, "Again?", max_tokens=8, temperature=0)
            status = c.request("status")  # answered after this turn's segment is written
            files = {p for p in (tmp_path / "cache" / "segments").rglob("*") if p.is_file()}
            index = SegmentIndex(tmp_path / "cache")
            listed = {row.path for row in index.chain(sid)}
            index.close()
    finally:
        d.terminate()
    # The unindexed file was never loaded (nothing restored) and was swept away.
    assert done["type"] == "chat.done" and done["usage"]["restored_from"] == "none"
    assert status["tiers"]["disk"]["segments"] == 1
    assert files == listed and len(files) == 1


def test_kvd_status_command(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path)
    try:
        with d.client() as c:
            sid = c.request("session.create")["session"]["id"]
            c.chat(sid, "hi", max_tokens=4, temperature=0)
        out = subprocess.run([sys.executable, "-m", "daemon.cli", "status", "--data-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        for word in ("resident", "warm", "disk", "budget", "page-outs"):
            assert word in out.stdout
        # Where the daemon is, for both kinds of client, and which BLAS it runs on.
        api = d.base_url
        assert f"OpenAI API at {api} · API key: the token in {tmp_path / 'token'}" in out.stdout
        assert any(f"OpenAI API at {api} (API key: the token in {tmp_path / 'token'})" in line for line in d.log)
        root = api.removesuffix("/v1")
        assert f"Anthropic API at {root} · the same key" in out.stdout
        assert any(f"Anthropic API at {root} (the same key" in line for line in d.log)
        assert "BLAS: " in out.stdout
        raw = subprocess.run([sys.executable, "-m", "daemon.cli", "status", "--json", "--data-dir",
                              str(tmp_path)], capture_output=True, text=True, timeout=60)
        tiers = json.loads(raw.stdout)["tiers"]
        assert tiers["resident"]["sessions"] == 1 and tiers["disk"]["segments"] == 1
    finally:
        d.terminate()
    out = subprocess.run([sys.executable, "-m", "daemon.cli", "status", "--data-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "kvd serve" in out.stderr


def test_after_a_restart_prefetch_makes_the_next_turn_a_resident_hit(tmp_path: Path) -> None:
    """Prefetch on: the session used last is paged into memory (resident: there is room) once
    the model is ready, and its next turn is served from there, with the same greedy answer
    as a cold restart's."""
    import shutil
    import time

    data = tmp_path / "data"
    d = DaemonProcess(data)
    with d.client() as c:
        sid = c.request("session.create")["session"]["id"]
        c.chat(sid, "Hello, this is a conversation to remember.", max_tokens=20, temperature=0)
        _, before = c.chat(sid, "And a second turn.", max_tokens=20, temperature=0)
    assert d.terminate() == 0
    shutil.copytree(data, tmp_path / "cold")

    answers = {}
    for name, prefetch in (("data", True), ("cold", False)):
        d = DaemonProcess(tmp_path / name, prefetch=prefetch)
        try:
            with d.client() as c:
                deadline = time.monotonic() + 60
                while prefetch and c.request("status")["prefetched"].get("sessions", 0) < 1:
                    assert time.monotonic() < deadline, "the prefetch never finished"
                answer, done = c.chat(sid, "After the restart?", max_tokens=10, temperature=0)
                _, again = c.chat(sid, "And once more.", max_tokens=2, temperature=0)
        finally:
            d.terminate()
        answers[name] = (answer, done["usage"])
        assert again["usage"]["restored_from"] == "resident" and again["usage"]["prefetched"] is False
    (warm_answer, warm), (cold_answer, cold) = answers["data"], answers["cold"]
    assert warm["restored_from"] == "resident" and cold["restored_from"] == "disk"
    assert warm["prefetched"] is True and cold["prefetched"] is False  # kvchat: "resident (prefetched from disk)"
    b = before["usage"]
    assert warm["restored_tokens"] == cold["restored_tokens"] == b["prompt_tokens"] + b["completion_tokens"]
    assert warm_answer == cold_answer


def test_each_model_keeps_its_own_cache_across_ten_switches(tmp_path: Path) -> None:
    """A daemon on one model, then the other, and back, ten times: every conversation restores the
    cache of the model serving it (never another's, never nothing), and the session list shows a
    tier only for the serving model's caches."""
    models = ("builtin:tiny", "builtin:tiny-swa")
    own: dict[str, str] = {}  # model -> a session only it serves
    both = ""  # a session both models serve in turn
    fed: dict[tuple[str, str], int] = {}  # (model, session) -> ids that model's cache of it holds
    for switch in range(11):
        model = models[switch % 2]
        d = DaemonProcess(tmp_path, "--model", model)
        try:
            with d.client() as c:
                if model not in own:
                    own[model] = c.request("session.create")["session"]["id"]
                    both = both or c.request("session.create")["session"]["id"]
                listed = {s["id"]: s["cache"] for s in c.request("session.list")["sessions"]}
                other = own.get(models[(switch + 1) % 2])
                assert listed[own[model]] == ("disk" if (model, own[model]) in fed else "none")
                if other is not None:  # kept for the other model: never shown as a tier this one restores from
                    assert listed[other] == "none"
                for sid in (own[model], both):
                    text = f"{'Both' if sid == both else 'Mine'}, number {switch}: tell me more."  # no prefix shared
                    answer, done = c.chat(sid, text, max_tokens=6, temperature=0)
                    # (An empty answer would make the next turn render the conversation afresh, which a
                    # sliding window's cache cannot follow: not what this test is about.)
                    assert done["type"] == "chat.done" and answer, done
                    u = done["usage"]
                    if (model, sid) in fed:
                        assert u["restored_from"] == "disk", (switch, model, sid, u)
                        assert u["restored_tokens"] == fed[model, sid], (switch, model, sid, u)
                    fed[model, sid] = u["prompt_tokens"] + u["completion_tokens"]
        finally:
            assert d.terminate() == 0
