"""A stateless request's prompt ids from its last request's, so a turn tokenizes only its new text.

An OpenAI client sends the whole conversation each time, and its ids must
be exactly the conversation rendered and tokenized whole (placement.py says
why: a greedy answer is then the same whichever cache it came from). Of
that work, encoding is the part that grows: at ~10k tokens (240 messages)
on a 2-core CPU the chat template renders the text in ~1 ms and the
tokenizer encodes it in ~6 ms, every turn.

So every request is rendered whole, as a fresh daemon would render it, and
only the encoding is taken from the last request: rendering costs a fraction
of encoding (measured in docs/benchmarks.md; Qwen3's template is the slow
one, about as slow to render as its text is to encode). The tokenizer stage
remembers each request's ids up to its last *anchors* (added tokens such as
`<|im_start|>`; the last CUTS of them, as a generation prompt may hold more
than one that the next render writes otherwise), with the length and digest
of the rendered text up to and including each, keyed by the hash chain of the
request's messages (sessions/chains.py; placement computes it anyway) and its
tools as the client sent them. A later request that carries those messages is
checked against its own whole render: where that render begins with exactly
the remembered text up to a cut (same length, same digest), its ids are the
remembered ones up to it followed by the encoding of the text after it; the
last such cut wins. Where none agrees (a template that rewrote an earlier
turn: Qwen3 stripping an earlier answer's reasoning once a new question
comes; tools in another key order, which `tojson` prints as sent) the request
is encoded whole. Nothing about a template is assumed: the render is compared.

Why the result is the whole render's encoding: Hugging Face tokenizers cut
the text at every added token before anything else, and encode each piece
on its own; so the ids before an anchor do not depend on what follows it,
and the ids after it are those of the text after it, encoded behind that
anchor (the anchor is encoded too and dropped, so a pre-tokenizer that
treats the start of the text differently sees the same context). That holds
for an anchor only where every occurrence of its text is cut out as that
token: an added token matched verbatim that swallows no neighbouring
whitespace (not normalized, no lstrip/rstrip/single_word), that no other
added token contains, and that no other added token can overlap from the
left (the tokenizer takes the leftmost match). `anchors` keeps only those.

What encodes whole: the first request of a conversation (or one whose last
request is no longer remembered: a restart, or more than REMEMBERED
conversations since); a request whose render agrees with no remembered cut;
a tokenizer without anchors, or one that is not a fast (Rust) tokenizer.
tests/test_render_templates.py checks
every request of generated conversations against a whole render over
llama.cpp's 70 real chat templates.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .prompt import Templated, render

#: Conversations whose last requests are remembered (their ids, 4 bytes a token). Each keeps two
#: entries: its last request, which the next one continues, and the one before, which a client that
#: edits or regenerates its last message continues; so the LRU holds twice as many requests.
REMEMBERED = 128
DIGEST = 32
CUTS = 4  # the last anchors of a request a next one may continue from (a generation prompt may hold three)


@dataclass(frozen=True)
class _Cut:
    """A place a request's ids may be continued from: just after an anchor."""

    ids: int  # how many ids, up to and including the anchor
    length: int  # characters of the render, up to and including the anchor
    digest: bytes  # of those characters
    anchor: int  # the anchor's id
    text: str  # the anchor's text


@dataclass(frozen=True)
class _Last:
    """What a request's ids leave for the next one: the ids up to its last cut, and its last few cuts."""

    head: array[int]
    cuts: tuple[_Cut, ...]  # in order, the last one ending `head`

    def continued(self, text: str) -> _Cut | None:
        """The last cut `text` (a whole render) begins with exactly the text before: the same
        characters up to it (their digest), so the same ids."""
        h = hashlib.blake2b(digest_size=DIGEST)
        done, digests = 0, []
        for cut in self.cuts:
            if cut.length > len(text):
                break
            h.update(text[done:cut.length].encode("utf-8", "surrogatepass"))
            done = cut.length
            digests.append(h.digest())
        return next((cut for cut, d in zip(reversed(self.cuts[:len(digests)]), reversed(digests), strict=True)
                     if d == cut.digest and text.startswith(cut.text, cut.length - len(cut.text))), None)


def anchors(tokenizer: Any) -> dict[int, str]:
    """The added tokens a render may be cut after (see the module docstring); none for a slow tokenizer.
    (A template that writes today's date needs no exception: tomorrow's render is other text.)"""
    if not getattr(tokenizer, "is_fast", False):
        return {}
    decoder: Mapping[int, Any] = getattr(tokenizer, "added_tokens_decoder", {})
    contents = sorted({t.content for t in decoder.values() if t.content})
    # Every proper suffix of every added token, sorted: a token contains an anchor past its start where
    # one of its suffixes begins with it, and may overlap one from the left where a suffix is its prefix.
    suffixes = sorted({c[i:] for c in contents for i in range(1, len(c))})
    ends = set(suffixes)

    def alone(text: str) -> bool:
        at = bisect.bisect_left(suffixes, text)
        if at < len(suffixes) and suffixes[at].startswith(text):
            return False  # inside another token
        at = bisect.bisect_right(contents, text)
        if at < len(contents) and contents[at].startswith(text):
            return False  # another token begins with it (the longest match wins)
        return not any(text[:i] in ends for i in range(1, len(text)))  # another may end inside it

    return {i: t.content for i, t in decoder.items()
            if t.content and not (t.normalized or t.lstrip or t.rstrip or t.single_word) and alone(t.content)}


def tools_key(tools: Sequence[Mapping[str, Any]] | None) -> bytes:
    """The tools as the template sees them: in the client's key order (`tojson` keeps it)."""
    if not tools:
        return b""
    return hashlib.blake2b(json.dumps(tools, ensure_ascii=False).encode("utf-8", "surrogatepass"),
                           digest_size=16).digest()


class Renders:
    """Each remembered conversation's last requests (an LRU); used from the tokenizer stage only."""

    def __init__(self, remembered: int = REMEMBERED) -> None:
        self._last: OrderedDict[tuple[bytes, bytes], _Last] = OrderedDict()
        self._entries = 2 * remembered  # two a conversation (REMEMBERED says why)
        self._anchors: dict[int, str] | None = None
        self.appended = 0  # requests whose ids were made from the last ones (statistics, tests)
        self.whole = 0  # requests encoded whole

    def ids(self, tokenizer: Any, messages: Sequence[Templated], system: str | None,
            tools: list[dict[str, Any]] | None, chain: Sequence[bytes] | None) -> list[int]:
        """The conversation's ids as a fresh render and encode gives them; `chain` is its messages' hash
        chain rooted in `system` (sessions/chains.py), None if the caller has none."""
        if self._anchors is None:
            self._anchors = anchors(tokenizer)
        text = render(tokenizer, [m.for_template() for m in messages], system, tools=tools)
        if chain is None or len(chain) != len(messages) or not messages or not self._anchors:
            self.whole += 1
            return list(tokenizer.encode(text, add_special_tokens=False))
        key = tools_key(tools)
        found = self._continued(chain, key, text)
        ids = self._encoded(tokenizer, text, *found) if found is not None else None
        if ids is None:
            found = None
            self.whole += 1
            ids = list(tokenizer.encode(text, add_special_tokens=False))
        else:
            self.appended += 1
        self._remember(tokenizer, (chain[-1], key), ids, text, found)
        return ids

    def _continued(self, chain: Sequence[bytes], key: bytes, text: str) -> tuple[_Last, _Cut] | None:
        """The longest remembered earlier request whose render `text` continues, and where."""
        for covered in range(len(chain), 0, -1):  # a dictionary look-up per prefix, longest first
            last = self._last.get((chain[covered - 1], key))
            if last is not None and (cut := last.continued(text)) is not None:
                self._last.move_to_end((chain[covered - 1], key))
                return last, cut
        return None

    @staticmethod
    def _encoded(tokenizer: Any, text: str, last: _Last, cut: _Cut) -> list[int] | None:
        """`text`'s ids: the remembered ones up to the cut, and the encoding of the text after it."""
        tail: list[int] = list(tokenizer.encode(cut.text + text[cut.length:], add_special_tokens=False))
        if not tail or tail[0] != cut.anchor:
            return None
        return last.head[:cut.ids].tolist() + tail[1:]

    def _remember(self, tokenizer: Any, key: tuple[bytes, bytes], ids: list[int], text: str,
                  found: tuple[_Last, _Cut] | None) -> None:
        """Keep `ids` up to their last anchor, and their last CUTS anchors as places to continue from.

        `found`, when the ids were made from it, holds cuts of them already (those up to the one used).
        Each new cut is the last occurrence of its anchor's text before the next cut (every occurrence of an
        anchor's text is that token: `anchors`). Whole ids are checked once: the text from the first new cut,
        encoded, must give exactly the ids from there (otherwise nothing is kept, the next request encodes
        whole); ids made from a cut are that encoding already.
        """
        assert self._anchors is not None
        old = () if found is None else tuple(c for c in found[0].cuts if c.ids <= found[1].ids)
        since = old[-1].ids if old else 0  # the ids before are the old head's
        new: list[tuple[int, int]] = []  # (the anchor's index in ids, its start in text), last first
        end = len(text)
        for i in range(len(ids) - 1, since - 1, -1):
            if len(new) == CUTS:
                break
            if (anchor := self._anchors.get(ids[i])) is not None:
                end = text.rfind(anchor, old[-1].length if old else 0, end)
                if end < 0:
                    return
                new.append((i, end))
        if not new and not old:
            return
        new.reverse()
        if new and found is None:
            first, start = new[0]
            if list(tokenizer.encode(text[start:], add_special_tokens=False)) != ids[first:]:
                return
        h = hashlib.blake2b(digest_size=DIGEST)
        done, cuts = 0, list(old[-(CUTS - len(new)):] if len(new) < CUTS else ())
        for i, start in new:
            length = start + len(self._anchors[ids[i]])
            h.update(text[done:length].encode("utf-8", "surrogatepass"))
            done = length
            cuts.append(_Cut(i + 1, length, h.digest(), ids[i], self._anchors[ids[i]]))
        end_ids = cuts[-1].ids
        head = (found[0].head[:since] + array("i", ids[since:end_ids]) if found is not None
                else array("i", ids[:end_ids]))
        self._last[key] = _Last(head, tuple(cuts))
        self._last.move_to_end(key)
        while len(self._last) > self._entries:
            self._last.popitem(last=False)
