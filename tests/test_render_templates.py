"""Over ~70 real chat templates (tests/data/chat_templates, llama.cpp's corpus): every request's ids through
daemon/renders.py equal the whole render's, exactly, and the incremental path runs where it can.

Each template runs on builtin:tiny's real tokenizer with the template's own special tokens added (found
in its text: `<|im_start|>`, `<｜User｜>`, `[INST]`, `<start_of_turn>`, ...), so its turn markers are
anchors as they are in the model's own tokenizer. Conversations are generated (seeded): they grow,
branch back to an earlier request, edit an earlier message, resend a request; tools come with their
keys in a new order from request to request; tool calls are answered by `tool` messages or by user
messages wrapping `<tool_response>` (Qwen3's convention, which moves its "last query"); answers carry
`<think>` blocks, are empty, or hold special tokens as text; some carry their reasoning apart (`reasoning`,
the chat door's `reasoning_content`), and an edit may change an answer's reasoning alone (its own random
stream: the rest of each conversation is as it was without it). A step the template refuses (roles that
must alternate, no system role, ...) is not sent, as a client would get a 500 for it; a template that
refuses every conversation kvd could send is in CANNOT_LOAD with the reason.
"""

from __future__ import annotations

import copy
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jinja2 import TemplateError
from mlx_lm.utils import load_tokenizer
from tokenizers import AddedToken

from daemon.doors.placement import Said, links
from daemon.models.builtin import ensure_builtin
from daemon.prompt import conversation_ids
from daemon.renders import Renders, anchors

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
CONVERSATIONS = 6  # per template
REQUESTS = 20  # per conversation, at most

#: Templates kvd cannot serve, and why (the test checks that each still fails, so the list stays true).
CANNOT_LOAD = {
    "CohereForAI-c4ai-command-r-plus-tool_use": "needs tools, in Cohere's shape (a top-level `description`, "
                                                "`parameter_definitions`); kvd passes OpenAI's",
    "fireworks-ai-llama-3-firefunction-v2": "adds `functions` and `datetime` to the system prompt, strings its "
                                           "caller must pass; kvd (like transformers' chat template call) "
                                           "passes `tools`",
}
#: Templates that never take the incremental path, and why (checked both ways: one that starts taking it
#: must leave this list). None: those that write today's date take it too (tomorrow's render is other text).
WHOLE: dict[str, str] = {}

_SPECIAL = re.compile(r"<\|[^|<>'\"\s]{1,40}\|>|<｜[^｜<>'\"]{1,40}｜>|\[/?[A-Z_]{2,30}\]|<\|?[a-z_]{2,30}\|>"
                      r"|<\|[a-z_]{2,30}>|</?[a-z][a-z_]{0,30}>|\[gMASK\]")
_TEXT = ["hello", " world", "\n", "  ", "é", "e\u0301", "```", "\t", "12", "日本", " ", "\n\n", "assistant",
         "<think>", "</think>", "<tool_response>", '{"a": 1}']


def _names() -> list[str]:
    return sorted(p.stem for p in TEMPLATES.glob("*.jinja"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tokenizer(ensure_builtin("builtin:tiny", tmp_path_factory.mktemp("models")))


def _tokenizer(tiny: Any, name: str) -> tuple[Any, list[str]]:
    """builtin:tiny's tokenizer with the template and its special tokens; and those tokens."""
    template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    specials = sorted(set(_SPECIAL.findall(template)) | {"<|bos|>"})
    tok = copy.deepcopy(tiny)
    tok.chat_template = template
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.bos_token = "<|bos|>"  # what the model's own tokenizer would give `bos_token`
    return tok, specials


TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                      "parameters": {"type": "object", "required": ["a", "b"], "properties": {
                                          "a": {"type": "number", "description": "first"},
                                          "b": {"type": "number", "description": "second"}}}}},
    {"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "unit": {"type": "string",
                                                                               "enum": ["c", "f"]}}}}},
]


def _shuffled(value: Any, rng: random.Random) -> Any:
    """The same JSON with every object's keys in a new order (what a client's dict merge may send)."""
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {k: _shuffled(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


@dataclass
class Conversation:
    """One generated conversation: what it sends next, and what it sent."""

    rng: random.Random
    specials: list[str]
    system: str | None
    tools: list[dict[str, Any]] | None
    messages: list[Said] = field(default_factory=list)
    sent: list[list[Said]] = field(default_factory=list)
    calls: int = 0
    thinking: random.Random = field(default_factory=random.Random)  # whether, and what, an answer reasons

    def reasoning(self) -> str | None:
        if self.thinking.random() >= 0.3:
            return None
        return "".join(self.thinking.choice(_TEXT + self.specials) for _ in range(self.thinking.randint(1, 6)))

    def text(self, most: int = 8) -> str:
        pieces = _TEXT + self.specials
        return "".join(self.rng.choice(pieces) for _ in range(self.rng.randint(0, most)))

    def answer(self) -> list[Said]:
        """An assistant answer, and what answers it (a user message, or tool results either way)."""
        kind = self.rng.choice(["text", "think", "empty", "calls", "calls", "special"])
        if kind == "calls" and self.tools:
            calls = []
            for _ in range(self.rng.randint(1, 2)):
                self.calls += 1
                args = _shuffled({"a": self.rng.randint(0, 9), "b": self.rng.randint(0, 9), "city": self.text(3)},
                                 self.rng)
                calls.append({"id": f"call_{self.calls}", "name": self.rng.choice(["add", "weather"]),
                              "arguments": json.dumps(args, ensure_ascii=False)})
            content = self.rng.choice(["", "Let me check.", "<think>\nI need a tool.\n</think>\n\n"])
            out = [Said("assistant", content, tuple(calls), reasoning=self.reasoning())]
            if self.rng.random() < 0.5:
                return out + [Said("tool", self.text() or "42", (), c["id"]) for c in calls]
            results = "\n".join(f"<tool_response>\n{self.text() or '42'}\n</tool_response>" for _ in calls)
            return out + [Said("user", results)]
        content = {"text": self.text(), "empty": "", "special": self.rng.choice(self.specials) + self.text(),
                   "think": f"<think>\n{self.text()}\n</think>\n\n{self.text()}"}.get(kind, self.text())
        return [Said("assistant", content, reasoning=self.reasoning()), Said("user", self.text() or "?")]

    def step(self) -> list[Said]:
        """The next request's messages: mostly grown, sometimes branched, edited or sent again."""
        roll = self.rng.random()
        if not self.sent:
            return [Said("user", self.text() or "hi")]
        if roll < 0.1:
            return list(self.rng.choice(self.sent))  # sent again (a retry)
        if roll < 0.2:  # a branch: an earlier request, answered otherwise
            return [*self.rng.choice(self.sent), *self.answer()]
        if roll < 0.3:  # an earlier message edited
            grown = [*self.messages, *self.answer()]
            users = [i for i, m in enumerate(grown) if m.role == "user"]
            i = self.rng.choice(users)
            grown[i] = grown[i]._replace(content=grown[i].content + self.text(3) + "!")
            answers = [k for k, m in enumerate(grown) if m.role == "assistant"]
            if answers and self.thinking.random() < 0.3:  # and an answer's reasoning, sent back otherwise
                k = self.thinking.choice(answers)
                grown[k] = grown[k]._replace(reasoning=(grown[k].reasoning or "") + "?")
            return grown
        return [*self.messages, *self.answer()]


def _whole(tok: Any, messages: list[Said], system: str | None, tools: list[dict[str, Any]] | None) -> list[int]:
    return conversation_ids(tok, [m.for_template() for m in messages], system, tools)


def _accepted(tok: Any, settings: list[tuple[str | None, list[dict[str, Any]] | None]]
              ) -> tuple[str | None, list[dict[str, Any]] | None] | None:
    """The first (system prompt, tools) the template renders a first message with (an exception is a
    refusal), or None."""
    for system, tools in settings:
        try:
            _whole(tok, [Said("user", "hi")], system, tools)
        except Exception:
            continue
        return system, tools
    return None


def _run(tok: Any, specials: list[str], name: str, seed: int, r: Renders) -> int:
    """One conversation's requests, each checked against the whole render; returns how many were sent."""
    rng = random.Random(f"{name}/{seed}")
    with_tools = seed % 2 == 1 or name.endswith("tool_use")
    with_system = seed % 4 < 2
    # What the template accepts of the conversation's setting: system prompt and tools, or less.
    systems: list[str | None] = [*(["You are terse.\n"] if with_system else []), None]
    toolsets: list[list[dict[str, Any]] | None] = [*([TOOLS] if with_tools else []), None]
    found = _accepted(tok, [(s, t) for s in systems for t in toolsets])
    if found is None:
        return 0
    system, tools = found
    c = Conversation(rng, specials, system, tools, thinking=random.Random(f"{name}/{seed}/reasoning"))
    sent = 0
    for _ in range(REQUESTS):
        for _attempt in range(4):
            messages = c.step()
            asked = _shuffled(tools, rng) if tools and rng.random() < 0.5 else tools
            try:
                want = _whole(tok, messages, system, asked)
            except Exception:  # refused: a client would get an error; try another step
                continue
            got = r.ids(tok, messages, system, asked, links(system, messages))
            assert got == want, (name, seed, sent, messages)
            c.messages, sent = messages, sent + 1
            c.sent.append(messages)
            break
    return sent


@pytest.mark.parametrize("name", _names())
def test_every_request_feeds_the_whole_render(tiny: Any, name: str) -> None:
    tok, specials = _tokenizer(tiny, name)
    if name in CANNOT_LOAD:
        for tools in (TOOLS, None):
            with pytest.raises((TypeError, ValueError, LookupError, TemplateError)):
                _whole(tok, [Said("user", "hi")], None, tools)
        return
    r = Renders()
    sent = sum(_run(tok, specials, name, seed, r) for seed in range(CONVERSATIONS))
    assert sent >= CONVERSATIONS * REQUESTS // 2, f"{name}: the template refused most requests ({sent} sent)"
    assert r.whole + r.appended == sent
    if name in WHOLE:
        assert r.appended == 0, f"{name} now takes the incremental path: take it out of WHOLE"
    else:
        assert anchors(tok), name
        assert r.appended > 0, f"{name}: {sent} requests, none took the incremental path"
