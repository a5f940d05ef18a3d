"""A stateless request's prompt ids from its last request's, so a turn renders and tokenizes only its new messages.

An OpenAI client sends the whole conversation each time, and its ids must
be exactly the conversation rendered and tokenized whole (placement.py says
why: a greedy answer is then the same whichever cache it came from). Doing
that each request costs work that grows with the conversation: 5-9 ms of
rendering and encoding at 240 messages (5k tokens) on a 2-core CPU, every
turn, against 0.3-0.8 ms here.

Here the tokenizer stage remembers each request's ids, keyed by the hash
chain of its messages (sessions/chains.py; placement computes it anyway)
and its tools. The next request of the conversation carries those messages
and then new ones; its ids are the remembered ones up to their last
*anchor* (a special token such as `<|im_start|>`) followed by the encoding
of the text after it, which is the end of the last render plus what the
template adds for the new messages. That addition comes from rendering
only the last exchange with and without the new messages, as the
websocket door's continuation does (prompt.py's `_tail`).

Why the result is the whole conversation's encoding: Hugging Face
tokenizers cut the text at every added token before anything else, and
encode each piece on its own; so the ids before an anchor do not depend on
what follows it, and the ids after it are those of the text after it,
encoded behind that anchor (the anchor is encoded too and dropped, so a
pre-tokenizer that treats the start of the text differently sees the same
context). Anchors are added tokens that are matched verbatim and swallow
no neighbouring whitespace (not normalized, no lstrip/rstrip/single_word).

What falls back to the whole render: the first request of a conversation
(or one whose last request is no longer remembered: a restart, or more than
REMEMBERED conversations since); other tools, another system prompt, or an
earlier message changed (then the chain differs); a template that is not
append-only for this exchange (its render with the new messages does not
start with its render without); a tokenizer without anchors, or one that
is not a fast (Rust) tokenizer; a template that writes today's date.

The one assumption is the websocket door's: what a template adds for new
messages depends on the conversation's last exchange (from its last user
message on), not on the turns before it.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .prompt import Templated, render

REMEMBERED = 128  # conversations whose last request is remembered (each its ids, 4 bytes a token)


@dataclass(frozen=True)
class _Last:
    """What a request's ids leave for the next one: the ids up to the last anchor, and the text after it."""

    head: array[int]  # the ids up to and including the anchor
    anchor: str  # the anchor's text
    rest: str  # the rendered text after the anchor
    arguments: bytes  # the digest of the messages' tool-call arguments as sent (the chain compares them parsed)


def anchors(tokenizer: Any) -> dict[int, str]:
    """The added tokens a render may be cut after (see the module docstring). None for a slow tokenizer,
    or a template that writes today's date (Llama 3's): the remembered ids would keep yesterday's."""
    if not getattr(tokenizer, "is_fast", False) or "strftime_now" in str(getattr(tokenizer, "chat_template", "")):
        return {}
    decoder: Mapping[int, Any] = getattr(tokenizer, "added_tokens_decoder", {})
    return {i: t.content for i, t in decoder.items()
            if t.content and not (t.normalized or t.lstrip or t.rstrip or t.single_word)}


def tools_key(tools: Sequence[Mapping[str, Any]] | None) -> bytes:
    if not tools:
        return b""
    return hashlib.blake2b(json.dumps(tools, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass"),
                           digest_size=16).digest()


def _arguments(messages: Sequence[Templated]) -> bytes:
    """Tool-call arguments as the client wrote them: the chain hashes them parsed, a template shows them as sent."""
    h = hashlib.blake2b(digest_size=16)
    for m in messages:
        for c in m.tool_calls:
            h.update(c["arguments"].encode("utf-8", "surrogatepass") + b"\x00")
    return h.digest()


def _last_user(messages: Sequence[Templated], before: int) -> int:
    for i in range(before - 1, -1, -1):
        if messages[i].role == "user":
            return i
    return 0


class Renders:
    """Each remembered conversation's last request (an LRU); used from the tokenizer stage only."""

    def __init__(self, remembered: int = REMEMBERED) -> None:
        self._last: OrderedDict[tuple[bytes, bytes], _Last] = OrderedDict()
        self._remembered = remembered
        self._anchors: dict[int, str] | None = None
        self.appended = 0  # requests whose ids were made from the last ones (statistics, tests)
        self.whole = 0  # requests rendered and tokenized whole

    def ids(self, tokenizer: Any, messages: Sequence[Templated], system: str | None,
            tools: list[dict[str, Any]] | None, chain: Sequence[bytes] | None) -> list[int]:
        """The conversation's ids as a fresh render and encode gives them; `chain` is its messages' hash
        chain rooted in `system` (sessions/chains.py), None if the caller has none."""
        if self._anchors is None:
            self._anchors = anchors(tokenizer)
        key = tools_key(tools)
        if chain is not None and self._anchors and len(chain) == len(messages):
            found = self._appended(tokenizer, messages, system, tools, chain, key)
            if found is not None:
                self.appended += 1
                return found
        self.whole += 1
        text = render(tokenizer, [m.for_template() for m in messages], system, tools=tools)
        ids: list[int] = list(tokenizer.encode(text, add_special_tokens=False))
        if chain is not None and len(chain) == len(messages) and messages:
            self._remember(tokenizer, (chain[-1], key), ids, 0, text, _arguments(messages))
        return ids

    def _appended(self, tokenizer: Any, messages: Sequence[Templated], system: str | None,
                  tools: list[dict[str, Any]] | None, chain: Sequence[bytes], key: bytes) -> list[int] | None:
        """The ids from the longest remembered earlier request of this conversation, or None."""
        for covered in range(len(messages), 0, -1):  # a dictionary look-up per prefix, longest first
            last = self._last.get((chain[covered - 1], key))
            if last is None:
                continue
            self._last.move_to_end((chain[covered - 1], key))
            if last.arguments != _arguments(messages[:covered]):
                return None
            start = _last_user(messages, covered)
            history = [m.for_template() for m in messages[start:covered]]
            try:
                before = render(tokenizer, history, system, tools=tools)
                after = render(tokenizer, [*history, *(m.for_template() for m in messages[covered:])], system,
                               tools=tools)
            except Exception:  # a template may refuse a conversation cut short (roles must alternate, ...)
                return None
            if not (after.startswith(before) and before.endswith(last.rest)):
                return None
            text = last.rest + after[len(before):]
            tail: list[int] = list(tokenizer.encode(last.anchor + text, add_special_tokens=False))
            if not tail or self._anchors is None or self._anchors.get(tail[0]) != last.anchor:
                return None
            ids = last.head.tolist() + tail[1:]
            self._remember(tokenizer, (chain[-1], key), ids, len(last.head), text, last.arguments
                           if covered == len(messages) else _arguments(messages), last.head)
            return ids
        return None

    def _remember(self, tokenizer: Any, key: tuple[bytes, bytes], ids: list[int], since: int, text: str,
                  arguments: bytes, head: array[int] | None = None) -> None:
        """Keep `ids` up to their last anchor and the text after it. `text` is the render of ids[since:];
        ids[since - 1], when `since` > 0, is an anchor whose text encoded before `text` gave ids[since - 1:],
        and `head` holds ids[:since] (copied, not converted again).

        A new cut is checked: the text after the anchor, encoded behind it, must give exactly the ids after
        it; otherwise nothing is kept and the next request renders whole.
        """
        assert self._anchors is not None
        at = next((i for i in range(len(ids) - 1, max(since - 1, 0) - 1, -1) if ids[i] in self._anchors), None)
        if at is None:
            return
        anchor = self._anchors[ids[at]]
        if at == since - 1:  # no anchor among the new ids: the old cut stays, the text after it grows
            rest = text
        else:
            cut = text.rfind(anchor)
            if cut < 0:
                return
            rest = text[cut + len(anchor):]
            if list(tokenizer.encode(anchor + rest, add_special_tokens=False)) != ids[at:]:
                return
        kept = head + array("i", ids[since:at + 1]) if head is not None else array("i", ids[:at + 1])
        self._last[key] = _Last(kept, anchor, rest, arguments)
        self._last.move_to_end(key)
        while len(self._last) > self._remembered:
            self._last.popitem(last=False)
