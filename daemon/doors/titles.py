"""What an API session is called in the list: the user's own words, never a harness's wrapping.

A stateless client's conversation gets its title from its first request.
What a person typed ends the request their typing caused; what a client
sends before it is its own: few-shot examples (aider sends its "Change the
greeting to be more casual" as a user message, which titled every aider
session), a repository map, files it was given. So the title is the first
line of the last user message that has words of the user's in it.

Coding agents wrap and precede those words with their own text, which is
not a title: Claude Code puts `<system-reminder>` blocks (its context,
CLAUDE.md's contents) before them in the same message and wraps them in
`<session>` for its title request; Codex sends AGENTS.md
(`# AGENTS.md instructions for …` and an `<INSTRUCTIONS>` block) and an
`<environment_context>` block as user messages of their own. A harness's
context blocks are dropped, a tag that opens what is left is taken to wrap
the user's words, and a message with nothing left is not the user's. A door
whose conversation joins other text into the user's turn (the Messages
door's system messages) titles by the user's messages alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from protocol import DEFAULT_TITLE

from .placement import Said

TITLE_CHARS = 60

# Blocks of context a harness adds to a user message (Claude Code's, Codex's, IDE plugins'): dropped whole.
_CONTEXT = re.compile(
    r"<(system-reminder|environment_context|user_instructions|INSTRUCTIONS|ide_[a-z_]+|command-[a-z-]+"
    r"|local-command-[a-z-]+|user-prompt-submit-hook)\b[^>]*>.*?</\1>", re.S)
# The heading Codex (and others) put before a project's instructions file.
_INSTRUCTIONS_HEADING = re.compile(r"^#+ *(AGENTS|CLAUDE)\.md instructions for .*$", re.M | re.I)
# A tag that opens what is left, wrapping the user's words (Claude Code's <session> in its title request):
# its text is theirs.
_WRAPPED = re.compile(r"\s*<([A-Za-z][\w-]*)(?:\s[^>]*)?>(.*?)</\1>", re.S)


def users_words(text: str) -> str:
    """A user message's text without what a harness wrapped around it (empty: none of it is the user's)."""
    text = _INSTRUCTIONS_HEADING.sub("", _CONTEXT.sub("", text))
    while (m := _WRAPPED.match(text)) is not None and m[2].strip():
        text = m[2]
    return text.strip()


def title_for(messages: Sequence[Said]) -> str:
    """A new session's title: the first line of the request's last user message with words of the user's.

    A request that holds a whole earlier conversation (a retry, an edit, another server's history) is
    titled by its latest question; the session list shows it under the conversation it branches
    (sessions/branches.py)."""
    for m in reversed(messages):
        if m.role == "user" and (words := users_words(m.content)):
            line = words.splitlines()[0].strip()
            return line if len(line) <= TITLE_CHARS else line[:TITLE_CHARS - 1] + "…"
    return DEFAULT_TITLE
