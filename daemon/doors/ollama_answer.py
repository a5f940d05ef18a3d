"""One Ollama answer (/api/chat, /api/generate): a turn's events as NDJSON lines, or one JSON object.

The response's life is every door's (answering.py): it begins with the first
token, so a refusal found once the engine has the prompt (a conversation past
the context) is still an HTTP error with its status. Each delta is one line
`{"model", "created_at", "message": {"role": "assistant", "content"}, "done":
false}` (generate: `"response"`); an answer's tool calls come in a line of
their own once it ends, as Ollama's do; the last line (`"done": true`) has
Ollama's figures, durations in nanoseconds, and kvd's own (`kvd`: the
session, the prompt's tokens and how many were restored, from where). An
error after the answer began is a line `{"error": "..."}`, which Ollama's
clients raise.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from anyio.streams.memory import MemoryObjectReceiveStream

from ..config import Config
from ..events import AnswerDelta, AnswerDone, AnswerError, TurnEvent, cache_figures
from ..turn import Turn
from ..turns import Turns
from .answering import TurnResponse
from .httpdoor import api_error
from .ollama_schema import error_body, ollama_calls
from .openai_answer import token_logprobs

Send = Callable[[dict[str, Any]], Any]
NDJSON = "application/x-ndjson"


def created_at() -> str:
    """Now, as Ollama writes it (RFC 3339, UTC)."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def done_reason(reason: str) -> str:
    """Ollama's done_reason for kvd's: an answer cut short says "length", as on the OpenAI door, so no client
    takes it for a whole one (the `kvd` object keeps kvd's own reason)."""
    return "length" if reason in ("length", "cancelled") else "stop"


def figures(usage: Mapping[str, Any], *, started_ns: int, load_ns: int) -> dict[str, Any]:
    """The final object's counts and durations (nanoseconds), from the answer's usage."""
    completion = int(usage.get("completion_tokens") or 0)
    tps = usage.get("decode_tps")
    decode_s = (completion - 1) / tps if tps and completion > 1 else 0.0
    return {"total_duration": time.perf_counter_ns() - started_ns, "load_duration": load_ns,
            # The prompt's tokens the model read, as Ollama counts them: a cached prefix is not read again
            # (kvd's own figures say how many the cache gave).
            "prompt_eval_count": int(usage.get("prefill_tokens") or 0),
            "prompt_eval_duration": int(float(usage.get("prefill_ms") or 0.0) * 1e6),
            "eval_count": completion, "eval_duration": int(decode_s * 1e9)}


def kvd_figures(session_id: str, done: AnswerDone) -> dict[str, Any]:
    """kvd's own figures (its field in the final object): what the cache did for the prompt."""
    u = done.usage
    return {"session": session_id, "finish_reason": done.finish_reason,
            "prompt_tokens": int(u.get("prompt_tokens") or 0), "cached_tokens": int(u.get("cached_tokens") or 0),
            "restore_ms": u.get("restore_ms"), **cache_figures(u)}


class OllamaResponse(TurnResponse[TurnEvent]):
    """A chat (`chat=True`: a `message`) or generate (`response`) answer, NDJSON or one object."""

    def __init__(self, turns: Turns, config: Config, turn: Turn, events: MemoryObjectReceiveStream[TurnEvent],
                 headers: dict[str, str], *, stream: bool, chat: bool, model: str, started_ns: int, load_ns: int,
                 extra: Mapping[str, Any] | None = None):
        super().__init__(turns, config, turn, events, headers, stream=stream)
        self.chat, self.model, self.started_ns, self.load_ns = chat, model, started_ns, load_ns
        self.extra = dict(extra or {})  # more of kvd's own figures (a num_ctx it capped)

    def _head(self, done: bool) -> dict[str, Any]:
        return {"model": self.model, "created_at": created_at(), "done": done}

    def _text(self, text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if not self.chat:
            return {"response": text}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return {"message": message}

    async def _logprobs(self, done: AnswerDone) -> dict[str, Any]:
        """Ollama's logprobs (each answer token, its log-probability, its top alternatives), where asked for;
        streamed, they come whole with the last object."""
        if done.logprobs is None or self.turn.engine is None:
            return {}
        listed = await token_logprobs(self.turn.engine, done.logprobs, len(done.content) or 1 << 30)
        return {"logprobs": [{"token": t["token"], "logprob": t["logprob"],
                              "top_logprobs": [{"token": a["token"], "logprob": a["logprob"]}
                                               for a in t["top_logprobs"]]} for t in listed]}

    def _final(self, done: AnswerDone, text: str, *, calls: bool) -> dict[str, Any]:
        return {**self._head(True), **self._text(text, ollama_calls(done.calls) if calls else None),
                "done_reason": done_reason(done.finish_reason),
                **figures(done.usage, started_ns=self.started_ns, load_ns=self.load_ns),
                "kvd": {**kvd_figures(self.turn.session_id, done), **self.extra}}

    async def _error(self, send: Send, event: AnswerError) -> None:
        """An error before the answer began: a refusal (the turn core stored nothing of a session this
        request made, and took back what it added to a pinned one); the log says why."""
        e = api_error(event.code, event.message, model=self.config.model)
        await self.refuse(send, e, error_body(e))

    async def _whole(self, send: Send) -> None:
        async for event in self.events:
            if isinstance(event, AnswerDelta) and event.written is not None:
                event.written()  # nothing is sent before the end: the engine need not wait
            elif isinstance(event, AnswerDone):
                await self.send_body(send, 200, {**self._final(event, event.content, calls=True),
                                                 **await self._logprobs(event)})
                return
            elif isinstance(event, AnswerError):
                await self._error(send, event)
                return

    async def _stream(self, send: Send) -> None:
        async def line(obj: dict[str, Any]) -> None:
            if not self.started:
                await self.begin_response(send, 200, NDJSON)
            data = json.dumps(obj, ensure_ascii=False).encode() + b"\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})

        async for event in self.events:
            if isinstance(event, AnswerDelta):
                try:
                    await line({**self._head(False), **self._text(event.text)})
                finally:
                    if event.written is not None:
                        event.written()  # the answer's first token is out: the engine goes on
            elif isinstance(event, AnswerDone):
                if event.calls:
                    await line({**self._head(False), **self._text("", ollama_calls(event.calls))})
                await line({**self._final(event, "", calls=False), **await self._logprobs(event)})
                break
            elif isinstance(event, AnswerError):
                if not self.started:
                    await self._error(send, event)
                    return
                await line(error_body(api_error(event.code, event.message, model=self.config.model)))
                break
        if self.started:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
