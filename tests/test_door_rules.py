"""The door rules (daemon/doors/rules.py; docs/doors.md is their table), executed against every HTTP door
through its official client: the same request is answered the same way at the chat completions, Responses
and Messages doors (an output limit above what fits lowered, and said in the `kvd` object and the log; tools
for a model that calls none dropped, and logged; a field kvd does not know ignored), what kvd cannot do is
refused in the same words everywhere, and every refusal is logged once with its door, path, code and reason.
And what the doors make of agents' first requests: sessions titled by the user's words (daemon/doors/titles.py)."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import anthropic
import openai
import pytest

from conftest import running_daemon
from toolmodel import CALL_TEXT, WEATHER_TOOL, write_plain_model, write_tool_model

pytestmark = pytest.mark.anyio

FUNCTION: dict[str, Any] = cast(dict[str, Any], WEATHER_TOOL["function"])
SYSTEM = "Answer."
QUESTION = "What is the weather in Paris?"
ASKED = 1_000_000  # an output limit far above what fits (limits.max_tokens_limit is 4096, the context 8192)
DOORS = ("chat", "responses", "messages")


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose chat template calls no tools; greedy, it writes the tool model's call as text and ends."""
    root = tmp_path_factory.mktemp("plain")
    return write_plain_model(write_tool_model(root), root)


class Doors:
    """The three HTTP doors, each through its own official client, asked the same things."""

    def __init__(self, base: str, token: str, model: str):
        self.openai = openai.AsyncOpenAI(base_url=base, api_key=token, max_retries=0)
        self.anthropic = anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key=token, max_retries=0)
        self.model = model

    async def ask(self, door: str, question: str, *, extra: dict[str, Any] | None = None,
                  content: list[dict[str, Any]] | None = None, **asked: Any) -> tuple[str, dict[str, Any]]:
        """The answer's text and its `kvd` object, for a request of `asked` (tools: function specs; max_tokens;
        tool_choice as each door spells it) at `door`."""
        tools = asked.pop("tools", None)
        limit = asked.pop("max_tokens", None)
        choice = asked.pop("tool_choice", None)
        body: Any = {"temperature": 0, **(extra or {})}
        chat: Any = self.openai.chat.completions.create  # (called with the door's own keywords, built here)
        responses: Any = self.openai.responses.create
        messages: Any = self.anthropic.messages.create
        if door == "chat":
            user: Any = {"role": "user", "content": content or question}
            made: Any = await chat(
                model=self.model, messages=[{"role": "system", "content": SYSTEM}, user], extra_body=body,
                **({"tools": [{"type": "function", "function": f} for f in tools]} if tools else {}),
                **({"max_tokens": limit} if limit else {}), **({"tool_choice": choice} if choice else {}))
            return made.choices[0].message.content or "", made.model_extra["kvd"]
        if door == "responses":
            item: Any = {"role": "user", "content": content} if content else None
            made = await responses(
                model=self.model, instructions=SYSTEM, input=[item] if item else question, extra_body=body,
                **({"tools": [{"type": "function", **f} for f in tools]} if tools else {}),
                **({"max_output_tokens": limit} if limit else {}), **({"tool_choice": choice} if choice else {}))
            return made.output_text, made.model_extra["kvd"]
        made = await messages(
            model=self.model, system=SYSTEM, messages=[{"role": "user", "content": content or question}],
            max_tokens=limit or 64, extra_body=body, timeout=300,  # (a large max_tokens wants a timeout of its own)
            **({"tools": [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
                          for f in tools]} if tools else {}),
            **({"tool_choice": choice} if choice else {}))
        return made.content[0].text, made.model_extra["kvd"]

    async def close(self) -> None:
        await self.openai.close()
        await self.anthropic.close()


@asynccontextmanager
async def doors(data: Path, model: Path) -> AsyncIterator[Doors]:
    async with running_daemon(data, model=str(model)) as d:
        asking = Doors(d.url.replace("ws://", "http://"), d.token, model.name)
        try:
            yield asking
        finally:
            await asking.close()


def said(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


async def test_every_door_lowers_a_limit_above_what_fits_drops_tools_and_ignores_what_it_does_not_know(
        plain_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """opencode's 32000 max_tokens and its 10 tools on a model that calls none were two 400s at the chat door
    while the Responses and Messages doors answered: now each door answers the same, says so, logs it."""
    caplog.set_level(logging.INFO)
    long = "x " * 2_200  # a prompt that leaves less room in the 8k context than the 4096 limit
    answers: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    async with doors(tmp_path, plain_model) as asking:
        for door in DOORS:
            answers[door] = [
                await asking.ask(door, QUESTION, tools=[FUNCTION], max_tokens=ASKED, extra={"kvd_unknown": 1}),
                await asking.ask(door, f"{long} {QUESTION}", tools=[FUNCTION], max_tokens=ASKED)]
    for door, ((text, kvd), (long_text, long_kvd)) in answers.items():
        # The tools were not shown: the model's call is its text, as the chat template has no place for one.
        assert text == long_text == CALL_TEXT, (door, text)
        assert (kvd["max_tokens_asked"], kvd["max_tokens"], kvd["model"]) == (ASKED, 4096, str(plain_model)), kvd
        assert long_kvd["max_tokens_asked"] == ASKED and 16 <= long_kvd["max_tokens"] < 4096, long_kvd
        assert not kvd["context_full"] and not long_kvd["context_full"]  # each answer ended by itself
    assert len({tuple(kvd["max_tokens"] for _, kvd in a) for a in answers.values()}) == 1  # the same room at each
    api, turns = said(caplog, "kvd.api"), said(caplog, "kvd.turns")
    for door in DOORS:
        dropped = f"the model {plain_model} calls no tools: answering a {door} request that offered 1 without them"
        assert api.count(dropped) == 2, api
        lowered = [line for line in turns if f"({door}, " in line and f"max_tokens {ASKED} lowered to" in line]
        assert len(lowered) == 2, turns


def _refused(e: BaseException) -> tuple[int, str]:
    """A client's error as (status, message), from either client."""
    assert isinstance(e, (openai.APIStatusError, anthropic.APIStatusError)), e
    body: Any = e.body
    error = body.get("error", body) if isinstance(body, dict) else {}
    return e.status_code, str(error.get("message"))


IMAGE: dict[str, dict[str, Any]] = {
         "chat": {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
         "responses": {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
         "messages": {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}}
TEXT: dict[str, dict[str, Any]] = {"chat": {"type": "text", "text": QUESTION},
                                   "responses": {"type": "input_text", "text": QUESTION},
                                   "messages": {"type": "text", "text": QUESTION}}
FORCED: dict[str, Any] = {"chat": "required", "responses": "required", "messages": {"type": "any"}}
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


async def test_every_door_refuses_the_same_things_in_the_same_words_each_logged_once(
        plain_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvd.server")
    refusals: dict[tuple[str, str], tuple[int, str]] = {}
    async with doors(tmp_path, plain_model) as asking:
        for door in DOORS:
            with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as image:
                await asking.ask(door, QUESTION, content=[TEXT[door], IMAGE[door]])
            refusals[door, "image"] = _refused(image.value)
    for door in DOORS:
        status, message = refusals[door, "image"]
        where = {"chat": "messages[1]", "responses": "input[0]", "messages": "messages[0]"}[door] + ".content[1]"
        assert (status, message) == (400, f"{where} is {IMAGE[door]['type']!r} content; kvd serves text models "
                                          "and reads text only: send it as text, or leave it out"), (door, message)
    lines = said(caplog, "kvd.server")
    for door in DOORS:
        for code in ("unsupported_content",):
            mine = [line for line in lines if re.fullmatch(
                rf"refused \({door} door\) POST {PATHS[door]} from 127\.0\.0\.1:\d+ \(User-Agent '[^']+'\): "
                rf"HTTP 400 {code}: .+", line)]
            assert len(mine) == 1, (door, code, lines)  # once, with the door, the path, the code and the reason
    assert any("is 'image' content" in line for line in lines), lines


async def test_every_door_forces_a_call_through_the_grammar_on_a_model_that_calls_none(
        plain_model: Path, tmp_path: Path) -> None:
    """A forced tool call (OpenAI's "required", Anthropic's "any") is made at every door, on a model whose chat
    template has no tool calling (its tools are dropped from the prompt): the grammar holds the answer to one
    call (daemon/doors/forcedcall.py), which each door answers in its own shape. (The script model's logits
    are all equal, so greedy it would fill a string until max_tokens: the function takes a finite value.)"""
    finite: dict[str, Any] = {**FUNCTION, "parameters": {"type": "object", "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]}}
    async with doors(tmp_path, plain_model) as asking:
        chat = await asking.openai.chat.completions.create(
            model=asking.model, messages=[{"role": "user", "content": QUESTION}], max_tokens=200, temperature=0,
            tools=[{"type": "function", "function": cast(Any, finite)}], tool_choice=FORCED["chat"])
        responses = await asking.openai.responses.create(
            model=asking.model, input=QUESTION, max_output_tokens=200, temperature=0,
            tools=[cast(Any, {"type": "function", **finite})], tool_choice=FORCED["responses"])
        create: Any = asking.anthropic.messages.create
        messages = await create(
            model=asking.model, messages=[{"role": "user", "content": QUESTION}], max_tokens=200,
            extra_body={"temperature": 0}, tools=[{"name": finite["name"], "description": finite["description"],
                                                   "input_schema": finite["parameters"]}],
            tool_choice=FORCED["messages"])
    assert chat.choices[0].message.tool_calls, chat
    (call,) = chat.choices[0].message.tool_calls or []
    assert chat.choices[0].finish_reason == "tool_calls" and call.type == "function"
    assert call.function.name == FUNCTION["name"] and call.function.arguments in ('{"unit": "celsius"}',
                                                                                  '{"unit": "fahrenheit"}')
    assert [o.type for o in responses.output] == ["function_call"]
    assert messages.stop_reason == "tool_use" and [b.type for b in messages.content] == ["tool_use"]


REMINDER = ("<system-reminder>\nAs you answer the user's questions, you can use the following context:\n# claudeMd\n"
            "Contents of /work/CLAUDE.md (project instructions):\n\nRun the tests.\n</system-reminder>\n")


async def test_an_agents_first_requests_are_titled_by_the_users_words_and_grouped_by_its_conversation(
        tmp_path: Path) -> None:
    """Claude Code's sessions were listed as `<system-reminder>` and `<session>`: its question comes after its
    context in the same message, and its title request wraps the question in <session>. Codex sends AGENTS.md and
    its environment as user messages before the question. The titles are the user's words; the sessions one
    Claude Code conversation made (its metadata names it) are one row of the list."""
    async with running_daemon(tmp_path) as d:
        base = d.url.replace("ws://", "http://")
        claude = anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key=d.token, max_retries=0,
                                          default_headers={"User-Agent": "claude-cli/2.1.197 (external, cli)"})
        metadata: Any = {"user_id": '{"device_id":"d1","account_uuid":"","session_id":"c0ffee-1"}'}
        titled = "<session>\nSay hello in five words.\n</session>\n\nWrite the title in the language the user wrote in."
        asked: Any = [{"role": "user", "content": [{"type": "text", "text": titled}]}]
        await claude.messages.create(model="kvd", system=[{"type": "text", "text": "Write a title."}], messages=asked,
                                     max_tokens=4, metadata=metadata)
        asked = [{"role": "user", "content": [{"type": "text", "text": REMINDER},
                                              {"type": "text", "text": "Say hello in five words."}]},
                 {"role": "system", "content": "Available agent types for the Agent tool:\n- claude: anything"}]
        await claude.messages.create(model="kvd", system="You are Claude Code.", messages=asked, max_tokens=4,
                                     metadata=metadata)
        codex = openai.AsyncOpenAI(base_url=base, api_key=d.token, max_retries=0,
                                   default_headers={"User-Agent": "codex_exec/0.50.0"})
        await codex.responses.create(model="kvd", instructions="You are Codex.", store=False, max_output_tokens=4,
                                     extra_body={"prompt_cache_key": "0199-codex"}, input=[
            {"role": "developer", "content": "<permissions instructions>\nsandboxed\n</permissions instructions>"},
            {"role": "user", "content": "# AGENTS.md instructions for /work\n\n<INSTRUCTIONS>\nRun the tests.\n"
                                        "</INSTRUCTIONS>"},
            {"role": "user", "content": "<environment_context>\n  <cwd>/work</cwd>\n</environment_context>"},
            {"role": "user", "content": "List the files."}])
        await claude.close()
        await codex.close()
        listed = d.store.list_sessions(branches=True)
    by_title = {s["title"]: s for s in listed}
    assert sorted(by_title) == ["List the files.", "Say hello in five words."], [s["title"] for s in listed]
    claudes = [s for s in listed if s["title"] == "Say hello in five words."]
    assert len(claudes) == 2 and all("conversation c0ffee-1" in str(s["origin"]) for s in claudes), claudes
    first, second = sorted(claudes, key=lambda s: s["created_at"])
    assert second["branch_of"] == first["id"] and first["branch_of"] is None  # one row in kvchat's list
    assert str(by_title["List the files."]["origin"]) == "api (codex_exec/0.50.0; conversation 0199-codex)"


async def test_an_answer_that_filled_the_room_the_context_left_says_so(tmp_path: Path) -> None:
    """Claude Code asks for 64,000 tokens; beside a long prompt the answer gets the room the context leaves, and
    one cut there is not "max_tokens" (Claude Code: "exceeded the 64000 output token maximum") but Anthropic's
    own `model_context_window_exceeded`; the OpenAI doors say `length`, and every `kvd` object `context_full`.
    (builtin:tiny's random weights, greedy, write to the end of the room.)"""
    long = "x " * 4_040  # ~8,100 tokens of the 8,192-token context: under 100 left
    async with running_daemon(tmp_path) as d:
        base = d.url.replace("ws://", "http://")
        claude = anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key=d.token, max_retries=0)
        made = await claude.messages.create(model="kvd", messages=[{"role": "user", "content": long}],
                                            max_tokens=64_000, extra_body={"temperature": 0}, timeout=300)
        chat = openai.AsyncOpenAI(base_url=base, api_key=d.token, max_retries=0)
        cut = await chat.chat.completions.create(model="kvd", messages=[{"role": "user", "content": long}],
                                                 max_tokens=64_000, temperature=0)
        await claude.close()
        await chat.close()
    kvd: Any = (made.model_extra or {})["kvd"]
    assert made.stop_reason == "model_context_window_exceeded" and kvd["context_full"], (made.stop_reason, kvd)
    assert made.usage.output_tokens == kvd["max_tokens"] < 100 and kvd["max_tokens_asked"] == 64_000, kvd
    assert cut.choices[0].finish_reason == "length" and (cut.model_extra or {})["kvd"]["context_full"]
