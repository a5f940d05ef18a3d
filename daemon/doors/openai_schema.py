"""The OpenAI chat-completions request, validated; errors in OpenAI's shape.

pydantic in strict mode: "5" is not a number and true is not a count, as
for the websocket protocol (requests.py). Fields the API defines but kvd
does not implement are refused when they ask for something (n > 1,
logprobs, tools) and ignored when they are left at their defaults; unknown
fields are ignored, as OpenAI's clients add new ones often.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.limits import TEMPERATURE, TOP_P

from ..config import Config

MAX_STOPS = 4  # as OpenAI
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic names union members in error paths


class ApiError(Exception):
    """A request the API answers with an error body: {"error": {message, type, param, code}}."""

    TYPES = {
        HTTPStatus.BAD_REQUEST: "invalid_request_error",
        HTTPStatus.UNAUTHORIZED: "authentication_error",
        HTTPStatus.FORBIDDEN: "permission_error",
        HTTPStatus.NOT_FOUND: "not_found_error",
        HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
        HTTPStatus.CONFLICT: "conflict_error",
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
        HTTPStatus.SERVICE_UNAVAILABLE: "service_unavailable",
        HTTPStatus.INTERNAL_SERVER_ERROR: "server_error",
    }

    def __init__(self, status: HTTPStatus, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # accepted and ignored: the chat template has no place for it

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatRequest(_Strict):
    model: str | None = None  # accepted whatever it names: kvd serves the one model it loaded
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=TEMPERATURE.low, le=TEMPERATURE.high)
    top_p: float | None = Field(default=None, gt=TOP_P.low, le=TOP_P.high)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    logprobs: bool | None = None
    tools: list[Any] | None = None


def parse(body: Any, config: Config) -> ChatRequest:
    """A request body (already JSON-decoded) as a ChatRequest, or the ApiError that says what to fix."""
    if not isinstance(body, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
    try:
        req = ChatRequest.model_validate(body)
    except ValidationError as e:
        # A union (content: a string or a list of parts) reports one error per member; the
        # deepest says most (a part's wrong type, rather than "not a string").
        first = max(e.errors(), key=lambda err: len(err["loc"]))
        loc = [part for part in first["loc"] if isinstance(part, int) or part.isidentifier()
               and part not in _UNION_TAGS]
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
        got = repr(first.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{where or 'body'}: {first['msg']} (got {got})",
                       param=where or None) from None
    if req.n not in (None, 1):
        raise ApiError(HTTPStatus.BAD_REQUEST, "kvd generates one choice per request; send n = 1 "
                       "(or leave it out) and make several requests for several answers", param="n")
    if req.logprobs:
        raise ApiError(HTTPStatus.BAD_REQUEST, "kvd does not return logprobs; leave logprobs out", param="logprobs")
    if req.tools:
        raise ApiError(HTTPStatus.BAD_REQUEST, "kvd does not call tools; leave tools out", param="tools")
    limit = req.max_completion_tokens or req.max_tokens
    if limit is not None and limit > config.max_tokens_limit:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"max_tokens may be at most {config.max_tokens_limit} "
                       "(limits.max_tokens_limit in kvd's config.toml)",
                       param="max_completion_tokens" if req.max_completion_tokens else "max_tokens")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOPS:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"at most {MAX_STOPS} stop sequences", param="stop")
    for i, m in enumerate(req.messages):
        if len(m.text()) > config.max_text_chars:  # the same bound as the websocket door's
            raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}] is longer than {config.max_text_chars} characters "
                           "(limits.max_text_chars in kvd's config.toml)", param=f"messages[{i}].content",
                           code="string_above_max_length")
        if m.role == "system" and i > 0:
            raise ApiError(HTTPStatus.BAD_REQUEST, "kvd takes one system message, first in messages; "
                           f"messages[{i}] is a system message after the conversation began",
                           param=f"messages[{i}].role")
    if all(m.role == "system" for m in req.messages):
        raise ApiError(HTTPStatus.BAD_REQUEST, "messages has no user or assistant message to answer",
                       param="messages")
    return req


def stops(req: ChatRequest) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)
