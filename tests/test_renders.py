"""A stateless conversation's ids from its last request's (daemon/renders.py) are a whole render's, exactly.

Each request here is also rendered and tokenized whole (prompt.conversation_ids, what the OpenAI
door fed before) with builtin:tiny's real tokenizer and template, and the counts say which path
made the ids: a request that should append and renders whole instead fails as surely as wrong ids.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.utils import load_tokenizer

from daemon.doors.placement import Said, links
from daemon.models.builtin import ensure_builtin
from daemon.prompt import conversation_ids
from daemon.renders import REMEMBERED, Renders, anchors

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"}, "b": {"type": "number"}}}}}]
# Pieces that stress the cut: the anchors' own text, whitespace at message ends, text NFC composes.
PIECES = ["hello", " world", "\n", "  ", "é", "e\u0301", "<|im_start|>", "<|im_end|>", "```", "\t", "12", "日本",
          " ", "\n\n", "assistant"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tokenizer(ensure_builtin("builtin:tiny", tmp_path_factory.mktemp("models")))


def whole(tokenizer: Any, messages: Sequence[Said], system: str | None,
          tools: list[dict[str, Any]] | None = None) -> list[int]:
    return conversation_ids(tokenizer, [m.for_template() for m in messages], system, tools)


def ask(r: Renders, tokenizer: Any, messages: Sequence[Said], system: str | None,
        tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The request's ids through `r`, checked against the whole render."""
    got = r.ids(tokenizer, messages, system, tools, links(system, messages))
    assert got == whole(tokenizer, messages, system, tools)
    return got


@pytest.mark.parametrize("system", [None, "You are terse.\n"])
def test_a_growing_conversation_appends_and_stays_exact(tokenizer: Any, system: str | None) -> None:
    rng = random.Random(7)

    def text() -> str:
        return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 10)))

    r = Renders()
    convo = [Said("user", "the cache keeps " * 40)]
    for _ in range(40):
        ask(r, tokenizer, convo, system)
        convo += [Said("assistant", text()), Said("user", text() or "?")]
    assert (r.whole, r.appended) == (1, 39)


def test_tool_turns_append_and_arguments_are_shown_as_sent(tokenizer: Any) -> None:
    r = Renders()
    call = {"id": "call_1", "name": "add", "arguments": '{"b": 2, "a": 1}'}
    convo = [Said("user", "What is 1 + 2?")]
    ask(r, tokenizer, convo, None, TOOLS)
    convo += [Said("assistant", "", (call,)), Said("tool", "3", (), "call_1")]
    ask(r, tokenizer, convo, None, TOOLS)
    convo += [Said("assistant", "It is 3."), Said("user", "And 2 + 2?")]
    ask(r, tokenizer, convo, None, TOOLS)
    assert (r.whole, r.appended) == (1, 2)
    # The same call with its arguments written in another order: the same chain (placement compares
    # arguments parsed), another render. Its ids are that render's: continued from the user's message,
    # before the call, where the render still agrees with the remembered one.
    resent = [convo[0], Said("assistant", "", ({**call, "arguments": '{"a": 1, "b": 2}'},)), *convo[2:]]
    assert links(None, resent) == links(None, convo)
    assert ask(r, tokenizer, resent, None, TOOLS) != whole(tokenizer, convo, None, TOOLS)
    assert (r.whole, r.appended) == (1, 3)
    # Other tools: rendered whole.
    other = [{"type": "function", "function": {**TOOLS[0]["function"], "name": "plus"}}]
    ask(r, tokenizer, [*convo, Said("assistant", "4"), Said("user", "Thanks")], None, other)
    assert r.whole == 2


def reordered(value: Any) -> Any:
    """The same JSON with every object's keys in reverse order."""
    if isinstance(value, dict):
        return {k: reordered(value[k]) for k in reversed(value)}
    if isinstance(value, list):
        return [reordered(v) for v in value]
    return value


def test_tools_whose_keys_come_in_another_order_are_rendered_as_sent(tokenizer: Any) -> None:
    """`tool | tojson` keeps the client's key order: a follow-up whose tools' keys come in another order
    renders other text, and its ids are that text's (before, they were the last request's)."""
    r = Renders()
    convo = [Said("user", "What is 1 + 2?")]
    ask(r, tokenizer, convo, None, TOOLS)
    convo += [Said("assistant", "3"), Said("user", "And 2 + 2?")]
    other_order = reordered(TOOLS)
    assert other_order == TOOLS and list(other_order[0]) != list(TOOLS[0])
    assert ask(r, tokenizer, convo, None, other_order) != whole(tokenizer, convo, None, TOOLS)
    assert (r.whole, r.appended) == (2, 0)
    convo += [Said("assistant", "4"), Said("user", "Thanks")]
    ask(r, tokenizer, convo, None, other_order)  # the same order again: continued
    assert (r.whole, r.appended) == (2, 1)


def test_qwen3_keeps_or_strips_earlier_thinking_as_a_whole_render_does(tokenizer: Any) -> None:
    """Qwen3's template finds its last query by skipping user messages that wrap `<tool_response>`, and keeps
    the thinking of the answers after it: a request's render may change an earlier answer's text."""
    qwen3 = _with_template(tokenizer, (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8"))
    r = Renders()
    think = "<think>\nThe user wants a sum; call add.\n</think>\n\n"
    call = {"id": "call_1", "name": "add", "arguments": '{"a": 1, "b": 2}'}
    convo = [Said("user", "What is 1 + 2?")]
    ask(r, qwen3, convo, None, TOOLS)
    convo += [Said("assistant", think + "Let me add.", (call,)), Said("user", "<tool_response>\n3\n</tool_response>")]
    ask(r, qwen3, convo, None, TOOLS)  # the answer after the last query keeps its thinking
    convo += [Said("assistant", "<think>\nIt is 3.\n</think>\n\nIt is 3."), Said("user", "And 2 + 2?")]
    ask(r, qwen3, convo, None, TOOLS)  # a new query: both earlier answers lose their thinking
    convo += [Said("assistant", think + "Adding.", ({**call, "id": "call_2"},)),
              Said("user", "<tool_response>\n4\n</tool_response>")]
    ask(r, qwen3, convo, None, TOOLS)
    assert r.appended >= 2 and r.whole + r.appended == 4


def test_what_renders_whole(tokenizer: Any) -> None:
    r = Renders()
    convo = [Said("user", "one"), Said("assistant", "two"), Said("user", "three")]
    ask(r, tokenizer, convo[:1], "sys")
    ask(r, tokenizer, convo, "another system prompt")  # its chain has another root
    ask(r, tokenizer, [Said("user", "ONE"), *convo[1:]], "sys")  # an edited first message
    assert (r.whole, r.appended) == (3, 0)
    ask(r, tokenizer, convo, "sys")  # still remembered: appends
    ask(r, tokenizer, convo, "sys")  # the same request again: its own ids, exactly
    assert (r.whole, r.appended) == (3, 2)
    assert r.ids(tokenizer, convo, "sys", None, None) == whole(tokenizer, convo, "sys")  # no chain
    assert r.whole == 4


@pytest.mark.parametrize("conversations", [REMEMBERED, REMEMBERED + 1])
def test_remembered_conversations_continue_and_one_more_pushes_them_out(tokenizer: Any,
                                                                        conversations: int) -> None:
    """REMEMBERED conversations, interleaved, all continue (each keeps two entries); with one more, some
    request of each round pushes out the entry the next one needed."""
    r = Renders()
    convos = [[Said("user", f"conversation {i}")] for i in range(conversations)]
    for turn in range(5):
        for i, convo in enumerate(convos):
            ask(r, tokenizer, convo, None)
            convo += [Said("assistant", f"answer {turn}"), Said("user", f"more {i}")]
    if conversations <= REMEMBERED:
        assert r.appended == 4 * conversations
    else:
        assert r.appended < 4 * conversations


def _with_template(tokenizer: Any, template: str) -> Any:
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    assert other.chat_template == template
    return other


def test_a_template_that_moves_the_system_prompt_continues_from_before_it(tokenizer: Any) -> None:
    """Mistral's way: the system prompt goes with the last user message, so no render extends the last one;
    each continues from the last request's cut before that message."""
    template = ("{%- set ns = namespace(system='') -%}"
                "{%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.system = m.content -%}"
                "{%- elif m.role == 'user' -%}<|im_start|>user\n{% if loop.last %}{{ ns.system }}\n{% endif %}"
                "{{ m.content }}<|im_end|>\n"
                "{%- else -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif -%}{%- endfor -%}"
                "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
    moving = _with_template(tokenizer, template)
    r = Renders()
    convo = [Said("user", "one")]
    for turn in range(3):
        ask(r, moving, convo, "Be brief.")
        convo += [Said("assistant", f"answer {turn}"), Said("user", f"question {turn}")]
    assert (r.whole, r.appended) == (1, 2)


def test_anchors_are_the_added_tokens_every_occurrence_of_which_is_cut_out(tokenizer: Any) -> None:
    assert set(anchors(tokenizer).values()) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    from tokenizers import AddedToken

    other = copy.deepcopy(tokenizer)
    other.add_tokens([AddedToken(t, normalized=False) for t in ["<|im_start|>user", "x<|im_end|>", "x<|end"]])
    # One begins with <|im_start|> (the longest match wins), one holds <|im_end|> past its start, and one
    # may end inside <|endoftext|> (a leftmost match): none of the three is an anchor any more.
    assert set(anchors(other).values()) == {"<|im_start|>user", "x<|im_end|>", "x<|end"}


def test_a_template_that_writes_the_date_continues_only_on_the_same_day(tokenizer: Any) -> None:
    """Llama 3.2's and others' `strftime_now`: the same day, the render agrees; the next, it is other text
    from its first line, and its ids are the new render's."""
    def on(day: str) -> Any:
        return _with_template(tokenizer, f"Today is {day}.\n" + str(tokenizer.chat_template))

    r = Renders()
    convo = [Said("user", "one")]
    ask(r, on("26 Nov 2026"), convo, None)
    convo += [Said("assistant", "two"), Said("user", "three")]
    ask(r, on("26 Nov 2026"), convo, None)
    assert (r.whole, r.appended) == (1, 1)
    convo += [Said("assistant", "four"), Said("user", "five")]
    ask(r, on("27 Nov 2026"), convo, None)
    assert (r.whole, r.appended) == (2, 1)
    dated = _with_template(tokenizer, "{{ strftime_now('%d %b %Y') }}" + str(tokenizer.chat_template))
    assert anchors(dated) == anchors(tokenizer)
