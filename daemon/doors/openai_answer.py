"""One OpenAI answer: a turn's events (its choices', n > 1: choices.py) as a JSON body or as server-sent
events (docs/openai.md).

The response's life (when it starts, a client that hangs up or stops
reading) is every door's: answering.py. An answer that called tools (toolcalls.py) comes from the turn core
already split into its content and calls (the door hands it the splitter):
its text before the first call streams, its calls come at the end.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from anyio.streams.memory import MemoryObjectReceiveStream

from ..config import Config
from ..events import AnswerDelta, AnswerDone, AnswerError, AnswerToolCall, TokenLogprob, cache_figures
from ..turn import Chosen, Turn
from ..turns import Turns
from .answering import TurnResponse
from .choices import Ends
from .httpdoor import api_error
from .openai_schema import OpenAIChatRequest
from .toolcalls import openai_calls

log = logging.getLogger("kvd.api")


def usage_of(u: Mapping[str, Any]) -> dict[str, Any]:
    prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(u.get("cached_tokens") or 0)}}


def finish_reason_of(reason: str) -> str:
    """OpenAI's finish_reason for kvd's. An answer cut short (kvd stopping, chat.cancel from kvchat on the
    same session) says "length", OpenAI's value for an answer that ended before the model ended it, so a
    client never takes it for a whole one; the `kvd` object keeps kvd's own reason ("cancelled")."""
    return "length" if reason in ("length", "cancelled") else "stop"


class ChatResponse(TurnResponse[Chosen]):
    """One request's answer (its choices': choices.py) as OpenAI's JSON body or event stream."""

    def __init__(self, turns: Turns, config: Config, turn: Turn,
                 events: MemoryObjectReceiveStream[Chosen], req: OpenAIChatRequest, headers: dict[str, str]):
        super().__init__(turns, config, turn, events, headers, stream=req.stream)
        self.req = req
        self.created = int(time.time())
        self.ends = Ends(turn)

    def _kvd(self) -> dict[str, Any]:
        return {"session": self.turn.session_id, "finish_reason": self.ends.done[0].finish_reason,
                **cache_figures(self.ends.usage()), **self.ends.kvd()}

    def _usage(self) -> dict[str, Any]:
        """OpenAI's usage with the `kvd` object in it (where a client that logs usage keeps it)."""
        return {**usage_of(self.ends.usage()), "kvd": self._kvd()}

    async def _error(self, send: Callable[[dict[str, Any]], Any], event: AnswerError) -> None:
        """An error before the answer began: a refusal (the turn core stored nothing of a session this
        request made, and took back what it added to a pinned one)."""
        e = api_error(event.code, event.message, model=self.config.model)
        await self.refuse(send, e, e.body())

    async def _logprobs(self, done: AnswerDone) -> dict[str, Any] | None:
        """OpenAI's choice logprobs ({"content": [...]}: each answer token, its log-probability, its bytes, its
        top alternatives), where the request asked (logprobs: true)."""
        if done.logprobs is None or self.turn.engine is None:
            return None
        return {"content": await token_logprobs(self.turn.engine, done.logprobs, len(done.content))}

    def _called(self, event: AnswerDone) -> str:
        """The finish_reason of an answer (one that called tools the turn core kept as its content and calls)."""
        reason = finish_reason_of(event.finish_reason)
        return "tool_calls" if event.calls and reason == "stop" else reason

    async def _choice(self, index: int, event: AnswerDone) -> dict[str, Any]:
        calls = event.calls
        message: dict[str, Any] = {"role": "assistant", "content": event.content or (None if calls else "")}
        if calls:
            message["tool_calls"] = openai_calls(_stored(calls))
        choice = {"index": index, "message": message, "logprobs": await self._logprobs(event),
                  "finish_reason": self._called(event)}
        if (kvd := self.ends.kvd_of(index, event)) is not None:
            choice["kvd"] = kvd
        return choice

    async def _whole(self, send: Callable[[dict[str, Any]], Any]) -> None:
        async for index, event in self.events:
            if isinstance(event, AnswerDelta) and event.written is not None:
                event.written()  # nothing is sent before the end: the engine need not wait
            elif isinstance(event, AnswerDone):
                if not self.ends.end(index, event):
                    continue  # the others are still answering
                await self.send_body(send, 200, {
                    "id": self.turn.request_id, "object": "chat.completion", "created": self.created,
                    "model": self.turn.model or self.config.model,
                    "choices": [await self._choice(i, done) for i, done in self.ends.ordered()],
                    "usage": self._usage(), "kvd": self._kvd()})
                return
            elif isinstance(event, AnswerError):
                await self._error(send, event)
                return

    def _chunk(self, index: int, delta: dict[str, Any], finish: str | None = None,
               logprobs: dict[str, Any] | None = None, kvd: dict[str, Any] | None = None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if kvd is not None:
            choice["kvd"] = kvd
        chunk: dict[str, Any] = {
            "id": self.turn.request_id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.turn.model or self.config.model, "choices": [choice]}
        if self._usage_wanted():
            chunk["usage"] = None
        return chunk

    def _usage_wanted(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    async def _stream(self, send: Callable[[dict[str, Any]], Any]) -> None:
        async def sse(data: dict[str, Any] | str) -> None:
            payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
            await send({"type": "http.response.body", "body": f"data: {payload}\n\n".encode(), "more_body": True})

        async def begin() -> None:
            if not self.started:
                await self.begin_response(send, 200, "text/event-stream; charset=utf-8")
                for index in range(self.ends.n):
                    await sse(self._chunk(index, {"role": "assistant", "content": ""}))

        async for index, event in self.events:
            if isinstance(event, AnswerDelta):
                try:
                    await begin()
                    await sse(self._chunk(index, {"content": event.text}))
                finally:
                    if event.written is not None:
                        event.written()  # the answer's first token is out: the engine goes on
            elif isinstance(event, AnswerDone):
                await begin()
                if event.calls:
                    await sse(self._chunk(index, {"tool_calls": openai_calls(_stored(event.calls), streaming=True)}))
                # Streamed, the log-probabilities come whole with the last chunk (their tokens, not the deltas).
                await sse(self._chunk(index, {}, self._called(event), await self._logprobs(event),
                                      self.ends.kvd_of(index, event)))
                if not self.ends.end(index, event):
                    continue  # the others are still answering
                if self._usage_wanted():
                    await sse({"id": self.turn.request_id, "object": "chat.completion.chunk",
                               "created": self.created, "model": self.turn.model or self.config.model, "choices": [],
                               "usage": self._usage(), "kvd": self._kvd()})
                break
            elif isinstance(event, AnswerError):
                if not self.started:
                    await self._error(send, event)
                    return
                await sse(api_error(event.code, event.message, model=self.config.model).body())
                break
        if self.started:
            await sse("[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _stored(calls: Sequence[AnswerToolCall]) -> list[dict[str, str]]:
    return [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]


def _texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's own text (tokenizer stage)."""
    return [tokenizer.decode([i]) for i in ids]


async def token_logprobs(engine: Any, records: Sequence[TokenLogprob], limit: int) -> list[dict[str, Any]]:
    """The answer's tokens as OpenAI's logprobs.content: text, log-probability, UTF-8 bytes, top alternatives;
    the tokens that begin past `limit` characters (a stop sequence cut the text there) left out."""
    ids = sorted({r.token for r in records} | {i for r in records for i, _ in r.top})
    texts = dict(zip(ids, await engine.tokenize(_texts, ids)))
    out: list[dict[str, Any]] = []
    offset = 0
    for r in records:
        if offset >= limit and out:
            break
        text = texts[r.token]
        out.append({"token": text, "logprob": r.logprob, "bytes": list(text.encode()),
                    "top_logprobs": [{"token": texts[i], "logprob": v, "bytes": list(texts[i].encode())}
                                     for i, v in r.top]})
        offset += len(text)
    return out
