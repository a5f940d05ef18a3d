"""The OpenAI text-completions request (POST /v1/completions), validated; errors in OpenAI's shape.

Strict, with the shared shapes of protocol/shapes.py, as the chat door's
(openai_schema.py words a validation error). `prompt` is a string or a list
of token ids (or a list holding one of either: one prompt per request); an
empty prompt is refused. `max_tokens` defaults to 16, as OpenAI's. Fields the
API defines that kvd does not implement are refused when they ask for
something (several prompts, `best_of` > 1) and ignored when left at their
defaults; unknown fields are ignored.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from protocol.shapes import MaxTokens, Seed, Stop, Temperature, TopP
from protocol.shapes import stops as stop_list

from ..config import Config
from .httpdoor import ApiError
from .openai_schema import Choices, Knobs, StreamOptions, check_choices, checked_body, fits, validated

DEFAULT_MAX_TOKENS = 16  # OpenAI's
MAX_LOGPROBS = 20  # alternatives per position (OpenAI's own limit is 5; vLLM's and llama-server's 20)
MAX_PROMPT_IDS = 1 << 20


class CompletionRequest(Knobs):
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    suffix: str | None = None
    max_tokens: MaxTokens | None = DEFAULT_MAX_TOKENS
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: Stop = None
    seed: Seed | None = None
    n: Choices | None = None
    best_of: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    user: str | None = None

    @field_validator("prompt", "suffix")
    @classmethod
    def _fits(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str):
            return fits(value, info)
        if isinstance(value, list) and value and isinstance(value[0], str):
            for text in value:
                fits(text, info)
        return value

    def one_prompt(self) -> str | list[int]:
        """The request's one prompt (a string, or token ids)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) > 1:
                raise ApiError(HTTPStatus.BAD_REQUEST, f"prompt holds {len(p)} prompts; kvd answers one prompt per "
                               "request: send them one by one (their shared beginning is cached)", param="prompt")
            p = p[0]
        if not p:
            raise ApiError(HTTPStatus.BAD_REQUEST, "prompt is empty; send text or token ids to continue",
                           param="prompt")
        if isinstance(p, list):
            ids: list[int] = p  # type: ignore[assignment]  # validated: a list of ints
            if len(ids) > MAX_PROMPT_IDS or any(i < 0 for i in ids):
                raise ApiError(HTTPStatus.BAD_REQUEST, "prompt's token ids must be non-negative (and at most "
                               f"{MAX_PROMPT_IDS:,} of them)", param="prompt")
            return ids
        assert isinstance(p, str)
        return p


def parse(body: Any, config: Config, *, surrogates: bool = True) -> CompletionRequest:
    req = validated(CompletionRequest, checked_body(body, surrogates=surrogates, listed="prompt"), config)
    if req.best_of not in (None, 1):
        raise ApiError(HTTPStatus.BAD_REQUEST, "best_of: kvd returns the answers it draws, not the best of "
                       "several; leave best_of out (or 1)", param="best_of")
    check_choices(req.n, config)
    if req.suffix is not None and req.echo:
        raise ApiError(HTTPStatus.BAD_REQUEST, "echo with a suffix: the prompt of a fill-in-the-middle is not the "
                       "text before its answer; send one or the other", param="echo")
    req.one_prompt()
    req.knobs()  # logit_bias's keys are token ids
    return req


def stops(req: CompletionRequest) -> list[str]:
    return stop_list(req.stop)
