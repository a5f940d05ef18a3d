"""One text completion: a turn's events as OpenAI's `text_completion` body or its server-sent events.

The response's life is every door's (answering.py). `echo` puts the prompt's
text before the answer's (streamed: in the first chunk). The usage is the chat
door's (`prompt_tokens_details.cached_tokens`: what the cache gave), with
kvd's own figures beside it (`kvd`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from anyio.streams.memory import MemoryObjectReceiveStream

from ..config import Config
from ..events import AnswerDelta, AnswerDone, AnswerError, cache_figures
from ..turn import Chosen, Turn
from ..turns import Turns
from .answering import TurnResponse
from .choices import Ends
from .completions_schema import CompletionRequest
from .httpdoor import api_error
from .openai_answer import finish_reason_of, usage_of

Send = Callable[[dict[str, Any]], Any]


class CompletionResponse(TurnResponse[Chosen]):
    """One request's completion (its choices': choices.py) as OpenAI's body or its server-sent events."""

    def __init__(self, turns: Turns, config: Config, turn: Turn, events: MemoryObjectReceiveStream[Chosen],
                 req: CompletionRequest, headers: dict[str, str], *, echo: str | None, created: int):
        super().__init__(turns, config, turn, events, headers, stream=req.stream)
        self.req, self.echo, self.created = req, echo, created
        self.ends = Ends(turn)

    def _body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.turn.request_id, "object": "text_completion", "created": self.created,
                "model": self.turn.model or self.config.model, "choices": choices}

    def _kvd(self) -> dict[str, Any]:
        return {"session": self.turn.session_id, "finish_reason": self.ends.done[0].finish_reason,
                **cache_figures(self.ends.usage()), **self.ends.kvd()}

    def _usage(self) -> dict[str, Any]:
        return {**usage_of(self.ends.usage()), "kvd": self._kvd()}

    def _choice(self, index: int, text: str, finish: str | None = None, logprobs: dict[str, Any] | None = None,
                done: AnswerDone | None = None) -> dict[str, Any]:
        choice = {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}
        if done is not None and (kvd := self.ends.kvd_of(index, done)) is not None:
            choice["kvd"] = kvd
        return choice

    async def _error(self, send: Send, event: AnswerError) -> None:
        """An error before the answer began: a refusal (the turn core stored nothing of a session this
        request made, and took back what it added to a pinned one); the log says why."""
        e = api_error(event.code, event.message, model=self.config.model)
        await self.refuse(send, e, e.body())

    async def _logprobs(self, done: AnswerDone) -> dict[str, Any] | None:
        """OpenAI's logprobs object for the text returned (the echoed prompt's tokens first): each token's text,
        its log-probability, its alternatives, its offset in the text; the tokens after a stop sequence cut."""
        if done.logprobs is None or self.turn.engine is None:
            return None
        kept = list(done.prompt_logprobs or ()) if self.echo is not None else []
        answer = list(done.logprobs)
        ids = sorted({r.token for r in (*kept, *answer)} | {i for r in (*kept, *answer) for i, _ in r.top})
        texts = dict(zip(ids, await self.turn.engine.tokenize(_token_texts, ids)))
        offset, limit = 0, len(self.echo or "") + len(done.content)
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for n, r in enumerate((*kept, *answer)):
            if offset >= limit and n >= len(kept):
                break  # past a stop sequence: the text was cut there
            out["tokens"].append(texts[r.token])
            out["token_logprobs"].append(r.logprob)
            out["top_logprobs"].append({texts[i]: v for i, v in r.top} if r.logprob is not None else None)
            out["text_offset"].append(offset)
            offset += len(texts[r.token])
        return out

    async def _whole(self, send: Send) -> None:
        async for index, event in self.events:
            if isinstance(event, AnswerDelta) and event.written is not None:
                event.written()  # nothing is sent before the end: the engine need not wait
            elif isinstance(event, AnswerDone):
                if not self.ends.end(index, event):
                    continue  # the others are still answering
                body = self._body([self._choice(i, (self.echo or "") + done.content,
                                                finish_reason_of(done.finish_reason), await self._logprobs(done), done)
                                   for i, done in self.ends.ordered()])
                await self.send_body(send, 200, {**body, "usage": self._usage(), "kvd": self._kvd()})
                return
            elif isinstance(event, AnswerError):
                await self._error(send, event)
                return

    async def _sse(self, send: Send, data: dict[str, Any] | str) -> None:
        if not self.started:
            await self.begin_response(send, 200, "text/event-stream; charset=utf-8")
        payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        await send({"type": "http.response.body", "body": f"data: {payload}\n\n".encode(), "more_body": True})

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = self._body([choice])
        return {**body, "usage": None} if self._usage_wanted() else body

    async def _echo(self, send: Send) -> None:
        """Before the first chunk: each choice's text begins with the prompt's, where `echo` asked."""
        if not self.started and self.echo:
            for i in range(self.ends.n):
                await self._sse(send, self._chunk(self._choice(i, self.echo)))

    async def _stream(self, send: Send) -> None:
        async for index, event in self.events:
            if isinstance(event, AnswerDelta):
                try:
                    await self._echo(send)
                    await self._sse(send, self._chunk(self._choice(index, event.text)))
                finally:
                    if event.written is not None:
                        event.written()  # the answer's first token is out: the engine goes on
            elif isinstance(event, AnswerDone):
                await self._echo(send)
                # Streamed, the log-probabilities come whole with the last chunk (their tokens' text, not the
                # deltas', which the detokenizer cuts elsewhere).
                await self._sse(send, self._chunk(self._choice(index, "", finish_reason_of(event.finish_reason),
                                                               await self._logprobs(event), event)))
                if not self.ends.end(index, event):
                    continue  # the others are still answering
                if self._usage_wanted():
                    await self._sse(send, {**self._body([]), "usage": self._usage()})
                break
            elif isinstance(event, AnswerError):
                if not self.started:
                    await self._error(send, event)
                    return
                await self._sse(send, api_error(event.code, event.message, model=self.config.model).body())
                break
        if self.started:
            await self._sse(send, "[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _usage_wanted(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)


def _token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's own text (tokenizer stage)."""
    return [tokenizer.decode([i]) for i in ids]
