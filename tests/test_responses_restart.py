"""Stored responses across `kvd stop` + start and kill -9, against real `kvd serve` processes and the official
`openai` client: a response whose completion was sent is never lost, and `previous_response_id` continues
from the cache the conversation left on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from daemonproc import DaemonProcess

MODEL = "builtin:tiny"
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_output_tokens": 8}
LONG = " ".join(f"Rule {i}: answer in plain words and keep every promise made earlier." for i in range(100))


def api(d: DaemonProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.base_url, api_key=d.token, max_retries=0)


def conversation(d: DaemonProcess) -> Any:
    """Two responses, the second continuing the first; returns the second."""
    first = api(d).responses.create(input="Tell me about rivers.", instructions=LONG, **GREEDY)
    return api(d).responses.create(input="And lakes?", previous_response_id=first.id, instructions=LONG, **GREEDY)


def settled(d: DaemonProcess) -> None:
    """Wait until the caches the turns left are written (a status is answered after the writes queued before it)."""
    with d.client() as c:
        assert c.request("status")["type"] == "status"


@pytest.mark.parametrize("how", ["stop", "kill -9"])
def test_a_response_continues_from_its_cache_after_a_restart(tmp_path: Path, how: str) -> None:
    d = DaemonProcess(tmp_path)
    try:
        second = conversation(d)
        settled(d)
    finally:
        if how == "stop":
            assert d.terminate() == 0
        else:
            d.kill()
    d = DaemonProcess(tmp_path)
    try:
        third = api(d).responses.create(input="And seas?", previous_response_id=second.id, instructions=LONG,
                                        **GREEDY)
        again = api(d).responses.retrieve(second.id)
    finally:
        assert d.terminate() == 0
    assert third.model_extra["kvd"]["session"] == second.model_extra["kvd"]["session"]
    assert third.model_extra["kvd"]["restored_from"] == "disk"
    usage = third.usage
    assert usage is not None
    print(f"after {how}: {usage.input_tokens_details.cached_tokens} of {usage.input_tokens} input tokens cached")
    assert usage.input_tokens_details.cached_tokens >= 0.9 * usage.input_tokens, usage
    assert again.output_text == second.output_text and again.status == second.status


def test_a_response_whose_completion_was_sent_survives_kill_9_at_once(tmp_path: Path) -> None:
    """kill -9 the moment response.completed arrived: the response id was committed before it was sent."""
    d = DaemonProcess(tmp_path)
    try:
        first = api(d).responses.create(input="Remember me.", **GREEDY)
        with api(d).responses.stream(input="Still?", previous_response_id=first.id, **GREEDY) as stream:
            for event in stream:
                if event.type in ("response.completed", "response.incomplete"):
                    last = event.response
                    d.kill()
                    break
    finally:
        if d.proc.poll() is None:
            d.kill()
    d = DaemonProcess(tmp_path)
    try:
        kept = api(d).responses.retrieve(last.id)
        more = api(d).responses.create(input="Yes.", previous_response_id=last.id, **GREEDY)
    finally:
        assert d.terminate() == 0
    assert kept.output_text == last.output_text and kept.status == last.status
    assert (more.model_extra or {})["kvd"]["session"] == (last.model_extra or {})["kvd"]["session"]
