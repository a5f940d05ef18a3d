"""An agent-shaped session through each HTTP door: the same long prefix and the whole conversation, every step.

Run: .venv/bin/python bench/agents.py [--steps 20] [--restart-at 10]
     [--doors chat,responses,responses-stored,messages]
     [--model builtin:tiny]

A coding agent sends, at every step, its instructions and tool list (here
~6k tokens), then the whole conversation so far with every tool result. This
bench plays such an agent against a real `kvd serve`: each step streams one
short answer, then the agent appends a ~60-token tool result and asks again.
At `--restart-at` the daemon is stopped and started (caches on disk only). After
the session a second agent starts with the same prefix and its own task.

Doors (each a function below):
- chat: /v1/chat/completions, the whole conversation each step;
- responses: /v1/responses with store: false and the whole input each step (as Codex CLI);
- responses-stored: /v1/responses continuing the last response (previous_response_id), only the new input;
- messages: /v1/messages, Anthropic's (as Claude Code), the whole conversation each step.

Per step it prints the client's TTFT (request sent to first text byte), the input
tokens, the cached ones (restored instead of read) and the prefilled ones; then
per door: the median resident step, the restart step and its ratio to that
median, and the second agent's cached tokens against the prefix.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402

from daemonproc import DaemonProcess  # noqa: E402

MAX_TOKENS = 4
INSTRUCTIONS = "\n".join(
    f"Rule {i}: before you change a file, read it whole; run the tests that cover it; explain each change in one "
    f"short sentence; never touch files outside the task; prefer small commits (section {i % 17})."
    for i in range(60))
TOOLS = [{"name": f"tool_{i}", "description": f"Tool number {i}: reads, lists or edits files in the workspace, "
          "and runs commands in the sandbox, returning their output as text.",
          "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "a path"},
                                                          "limit": {"type": "integer"}}, "required": ["path"]}}
         for i in range(6)]


def tool_result(step: int) -> str:
    return f"Tool output {step}: " + " ".join(f"line {step}.{j}: ok, 3 files, 120 bytes" for j in range(3))


@dataclass
class Step:
    ttft: float  # the client's, seconds
    input_tokens: int
    cached: int
    restored_from: str | None
    kvd_ttft_ms: float  # kvd's own (from the turn core starting the turn)


@dataclass
class Agent:
    """One agent's conversation as each door needs it."""

    task: str
    said: list[tuple[str, str]] = field(default_factory=list)  # (role, text): user/assistant/tool, in order
    last_response: str | None = None  # the responses-stored door's previous_response_id
    new: list[tuple[str, str]] = field(default_factory=list)  # what that door has not sent yet


def _stream(client: httpx.Client, url: str, body: dict[str, Any],
            first: Callable[[str, dict[str, Any]], bool], last: Callable[[str, dict[str, Any]], dict[str, Any] | None],
            ) -> tuple[float, dict[str, Any]]:
    """POST `body`, stream the answer: (seconds to the first text, the final event's fields). `first` sees
    every event and says whether it carried text; `last` returns the final event's fields."""
    sent = time.perf_counter()
    ttft = None
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read()[:300]!r}")
        kind = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                if first(kind, data) and ttft is None:
                    ttft = time.perf_counter() - sent
                if (found := last(kind, data)) is not None:
                    return ttft if ttft is not None else time.perf_counter() - sent, found
    raise RuntimeError(f"{url}: the stream ended without its usage")


def chat_door(client: httpx.Client, base: str, agent: Agent) -> tuple[Step, str]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS},
                                      {"role": "user", "content": agent.task}]
    messages += [{"role": "user" if role == "tool" else role, "content": text} for role, text in agent.said]
    body = {"model": "kvd", "messages": messages, "tools": [{"type": "function", "function": t} for t in TOOLS],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    text: list[str] = []

    def first(kind: str, data: dict[str, Any]) -> bool:
        delta = data["choices"][0]["delta"].get("content") if data.get("choices") else None
        if delta:
            text.append(delta)
        return bool(delta)

    def last(kind: str, data: dict[str, Any]) -> dict[str, Any] | None:
        return data if data.get("usage") else None

    ttft, done = _stream(client, f"{base}/chat/completions", body, first, last)
    u = done["usage"]
    return Step(ttft, u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                done["kvd"]["restored_from"], done["kvd"]["ttft_ms"]), "".join(text)


def _responses(client: httpx.Client, base: str, body: dict[str, Any]) -> tuple[Step, str, str]:
    text: list[str] = []

    def first(kind: str, data: dict[str, Any]) -> bool:
        if kind == "response.output_text.delta":
            text.append(data["delta"])
            return True
        return False

    def last(kind: str, data: dict[str, Any]) -> dict[str, Any] | None:
        return data["response"] if kind in ("response.completed", "response.incomplete") else None

    ttft, done = _stream(client, f"{base}/responses", {
        **body, "model": "kvd", "instructions": INSTRUCTIONS, "tools": [{"type": "function", **t} for t in TOOLS],
        "max_output_tokens": MAX_TOKENS, "temperature": 0, "stream": True}, first, last)
    u = done["usage"]
    return (Step(ttft, u["input_tokens"], u["input_tokens_details"]["cached_tokens"], done["kvd"]["restored_from"],
                 done["kvd"]["ttft_ms"]), "".join(text), done["id"])


def _items(said: list[tuple[str, str]]) -> list[dict[str, Any]]:
    return [{"role": "user" if role == "tool" else role, "content": text} for role, text in said]


def responses_door(client: httpx.Client, base: str, agent: Agent) -> tuple[Step, str]:
    step, text, _ = _responses(client, base, {"store": False, "input": _items([("user", agent.task), *agent.said])})
    return step, text


def responses_stored_door(client: httpx.Client, base: str, agent: Agent) -> tuple[Step, str]:
    if agent.last_response is None:
        body: dict[str, Any] = {"input": _items([("user", agent.task), *agent.said])}
    else:
        body = {"input": _items(agent.new), "previous_response_id": agent.last_response}
    step, text, rid = _responses(client, base, body)
    agent.last_response = rid
    return step, text


def messages_door(client: httpx.Client, base: str, agent: Agent) -> tuple[Step, str]:
    """Anthropic's Messages API (Claude Code's): the whole conversation each step, tool results as user text."""
    said: list[dict[str, Any]] = []
    for who, words in [("user", agent.task), *agent.said]:
        role = "user" if who == "tool" else who
        if said and said[-1]["role"] == role:  # the API wants the roles to alternate
            said[-1]["content"] += "\n\n" + words
        else:
            said.append({"role": role, "content": words})
    body = {"model": "kvd", "system": INSTRUCTIONS, "messages": said, "max_tokens": MAX_TOKENS, "temperature": 0,
            "tools": [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
                      for t in TOOLS], "stream": True}
    text: list[str] = []

    def first(kind: str, data: dict[str, Any]) -> bool:
        delta = data.get("delta") or {}
        if kind == "content_block_delta" and delta.get("type") == "text_delta" and delta.get("text"):
            text.append(delta["text"])
            return True
        return False

    def last(kind: str, data: dict[str, Any]) -> dict[str, Any] | None:
        return data if kind == "message_delta" else None

    ttft, done = _stream(client, f"{base}/messages", body, first, last)
    u = done["usage"]
    return (Step(ttft, u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"],
                 done["kvd"]["restored_from"], done["kvd"]["ttft_ms"]), "".join(text))


DOORS: dict[str, Callable[[httpx.Client, str, Agent], tuple[Step, str]]] = {
    "chat": chat_door, "responses": responses_door, "responses-stored": responses_stored_door,
    "messages": messages_door,
}


def started(data: Path, model: str) -> DaemonProcess:
    """`kvd serve` with its model loaded (a step times kvd's answer, not its start)."""
    d = DaemonProcess(data, "--model", model, prefetch=True)  # kvd's default (tests turn it off)
    with d.client():
        pass
    return d


def run_door(door: str, steps: int, restart_at: int, model: str, root: Path, settle: float = 0.0) -> dict[str, Any]:
    data = root / door
    d = started(data, model)
    ask = DOORS[door]
    agent = Agent("Task: make the tests pass in the project under ./src, one file at a time.")
    rows: list[Step] = []
    try:
        client = httpx.Client(headers={"Authorization": f"Bearer {d.token}"}, timeout=600)
        for i in range(1, steps + 1):
            if i == restart_at:
                client.close()
                assert d.terminate() == 0
                d = started(data, model)
                time.sleep(settle)  # an agent resumed a moment after the restart: the start's prefetch has run
                client = httpx.Client(headers={"Authorization": f"Bearer {d.token}"}, timeout=600)
            step, answer = ask(client, d.base_url, agent)
            rows.append(step)
            said = [("assistant", answer), ("tool", tool_result(i))]
            agent.said += said
            agent.new = said[1:]  # the answer is the stored response's own: only the tool result is new
            print(f"{door:>16} step {i:2d}: TTFT {step.ttft * 1000:7.1f} ms (kvd {step.kvd_ttft_ms:7.1f}), input "
                  f"{step.input_tokens:5d}, cached "
                  f"{step.cached:5d}, prefilled {step.input_tokens - step.cached:5d}, from {step.restored_from}",
                  flush=True)
        second, _ = ask(client, d.base_url, Agent("Task: write the missing docs for ./src/tools, file by file."))
        client.close()
    finally:
        d.terminate()
    resident = [r.ttft for i, r in enumerate(rows, 1) if i not in (1, restart_at)]
    return {"door": door, "rows": rows, "resident_ms": statistics.median(resident) * 1000,
            "restart_ms": rows[restart_at - 1].ttft * 1000 if restart_at <= len(rows) else None,
            "second": second}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--restart-at", type=int, default=10)
    parser.add_argument("--doors", default="chat,responses,responses-stored,messages")
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--settle", type=float, default=0.0,
                        help="seconds between the restart's 'ready' and the next step (0: at once, before prefetch)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvd-agents-") as tmp:
        results = [run_door(door, args.steps, args.restart_at, args.model, Path(tmp), args.settle)
                   for door in args.doors.split(",")]
    print()
    for r in results:
        print(summary(r))


def summary(r: dict[str, Any]) -> str:
    """One door's figures: its first step, its resident steps, its restart, and the second agent."""
    first, second = r["rows"][0], r["second"]
    restart = f"{r['restart_ms']:.1f} ms ({r['restart_ms'] / r['resident_ms']:.2f}x)" if r["restart_ms"] else "-"
    return (f"{r['door']:>16}: first step {first.ttft * 1000:.0f} ms ({first.input_tokens} tokens), resident step "
            f"median {r['resident_ms']:.1f} ms, restart step {restart}, second agent cached {second.cached} of "
            f"{second.input_tokens} (the prefix and the first agent's task: {first.input_tokens})")

if __name__ == "__main__":
    main()
