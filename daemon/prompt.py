"""From a transcript to the token ids the model is fed.

A session's history is kept as the exact token ids that were fed, generated
tokens included, because re-templating and re-tokenizing a conversation can
change earlier tokens (templates trim content, tokenizers merge differently
across a boundary) and so throw away a cache that is still valid. A new turn
therefore appends only the tokens of the text the chat template adds after
that history: the end of the last assistant turn, the new messages and the
generation prompt. Comparing decoded text instead would break on the first
template that trims whitespace.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

_SENTINEL = "\x00kvd-sentinel\x00"


#: The names templates read an assistant's reasoning under: `reasoning_content` (Qwen3, GLM, Kimi,
#: DeepSeek; what vLLM-style clients send), `reasoning` (vLLM's newer name, which vLLM passes beside
#: it), `thinking` (gpt-oss, LFM2.5, and Anthropic's block). Templates that read more than one take them
#: as alternatives, so each is given the same text.
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def template_message(m: Mapping[str, Any]) -> dict[str, Any]:
    """A transcript message as chat templates take it: role and content, an assistant's tool calls
    (kept as {"id", "name", "arguments"}; templates want OpenAI's shape, arguments as an object, as
    Hugging Face's chat templates document it), the call a tool message answers, and an assistant's
    reasoning as its client sent it (under every name a template reads it by)."""
    out: dict[str, Any] = {"role": m["role"], "content": m["content"]}
    if reasoning := m.get("reasoning"):
        out.update(dict.fromkeys(REASONING_KEYS, reasoning))
    if calls := m.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": _arguments(c["arguments"])}}
                             for c in calls]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: the template shows it as it is


def _conversation(messages: Sequence[Mapping[str, Any]], system: str | None) -> list[dict[str, Any]]:
    head: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    return head + [template_message(m) for m in messages]


def render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], system: str | None,
           *, generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    extra = {"tools": list(tools)} if tools else {}
    text: str = tokenizer.apply_chat_template(_conversation(messages, system),
                                              add_generation_prompt=generation_prompt, tokenize=False, **extra)
    return text


def _continuation(tokenizer: Any, history: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]],
                  system: str | None, last_fed: int, eos_ids: Collection[int]) -> str | None:
    """The text to feed after tokens that end inside `history`'s last assistant turn.

    None when the template is not append-only (it rewrites earlier turns), in
    which case the caller retokenizes everything.
    """
    before = render(tokenizer, history, system, generation_prompt=False)
    after = render(tokenizer, [*history, *new], system)
    if not after.startswith(before):
        return None
    marked = render(tokenizer, [*history[:-1], {"role": "assistant", "content": _SENTINEL}],
                    system, generation_prompt=False)
    at = marked.rfind(_SENTINEL)
    if at < 0:
        return None
    closing = marked[at + len(_SENTINEL):]
    if last_fed in eos_ids:
        # The model already fed its end-of-turn token; the template's text for it is not fed again.
        eos_text = tokenizer.decode([last_fed], skip_special_tokens=False)
        if eos_text and closing.startswith(eos_text):
            closing = closing[len(eos_text):]
    return closing + after[len(before):]


def _tail(messages: Sequence[Mapping[str, Any]], covered: int) -> int:
    """Where the history a continuation is rendered from starts: the last user message it covers.

    What a template adds after a history depends on the history's last
    exchange, not on the turns before it (templates that drop earlier
    reasoning, or alternate roles, count from the last user message), so a
    turn renders that exchange and its new messages, never the whole
    conversation: the same work at turn 5 and at turn 500.
    """
    for i in range(covered - 1, -1, -1):
        if messages[i]["role"] == "user":
            return i
    return 0


def prompt_tokens(tokenizer: Any, messages: Sequence[Mapping[str, Any]], system: str | None,
                  fed: Sequence[int], *, fed_covers: int) -> tuple[list[int], bool]:
    """Token ids for the whole conversation `messages`, ready for generation: the turn core's own
    prompt (the fed-token rule), made in its tokenizer stage.

    `fed` are the ids the session fed so far; they cover `messages[:fed_covers]`,
    whose last one must be the assistant answer they end with. When that
    holds, `fed` is kept verbatim and only the continuation is tokenized.
    Otherwise (first turn, a crash cut an answer short, an edit) the whole
    conversation is tokenized afresh and the caller reuses whatever prefix of
    its cache still matches. The flag says whether the session's fed ids were
    rebuilt rather than appended to (never for a session that had none).
    """
    if fed and 0 < fed_covers < len(messages) and messages[fed_covers - 1]["role"] == "assistant":
        start = _tail(messages, fed_covers)
        rest = _continuation(tokenizer, messages[start:fed_covers], messages[fed_covers:], system,
                             fed[-1], tokenizer.eos_token_ids)
        if rest is not None:
            return list(fed) + list(tokenizer.encode(rest, add_special_tokens=False)), False
    return list(tokenizer.encode(render(tokenizer, messages, system), add_special_tokens=False)), bool(fed)


def conversation_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], system: str | None,
                     tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """The whole conversation as a fresh session would feed it (with the tools it may call)."""
    return list(tokenizer.encode(render(tokenizer, messages, system, tools=tools), add_special_tokens=False))


# --- how a turn's prompt ids are made (the turn core's rule, run by the tokenizer stage) ---


class Prompt(Protocol):
    """How a stateless request's prompt ids are made (a `MessagePrompt`): run by the tokenizer stage, never
    on the engine thread. A session's own turn needs none: its ids are `prompt_tokens`."""

    def ids(self, tokenizer: Any) -> tuple[list[int], bool]:
        """The prompt's token ids, and whether the session's fed ids were rebuilt rather than appended to."""
        ...

    @property
    def fed_before(self) -> int:
        """How many ids the session had fed in earlier turns (what a re-read is counted against)."""
        ...


class Templated(Protocol):
    """A stateless request's message (doors/placement.py's Said)."""

    @property
    def role(self) -> str: ...

    @property
    def tool_calls(self) -> Sequence[Mapping[str, str]]: ...

    def for_template(self) -> dict[str, Any]:
        """The message as template_message takes it."""
        ...


class Remembered(Protocol):
    """Stateless conversations' last renders (daemon/renders.py's Renders)."""

    def ids(self, tokenizer: Any, messages: Sequence[Templated], system: str | None,
            tools: list[dict[str, Any]] | None, chain: Sequence[bytes] | None) -> list[int]: ...


@dataclass(frozen=True)
class MessagePrompt:
    """A stateless request's whole conversation, rendered and tokenized as a fresh session would feed it.

    Its ids replace the session's fed ids: the old answer boundaries no longer apply. Its
    messages become template dicts here, in the tokenizer stage: a long conversation costs
    the event loop nothing. With `renders` (the turn core's, used in this stage only) and
    `chain` (the messages' hash chain rooted in `system`, from placement), a conversation
    whose render begins with exactly a remembered request's text encodes only the text
    after it (daemon/renders.py); the ids are the same.
    """

    messages: Sequence[Templated]
    system: str | None
    tools: list[dict[str, Any]] | None = None
    fed_before: int = 0  # a stateless request's earlier turns were fed by whatever it matched
    chain: Sequence[bytes] | None = None
    renders: Remembered | None = None

    def ids(self, tokenizer: Any) -> tuple[list[int], bool]:
        if self.renders is not None:
            return self.renders.ids(tokenizer, self.messages, self.system, self.tools, self.chain), True
        return conversation_ids(tokenizer, [m.for_template() for m in self.messages], self.system, self.tools), True
