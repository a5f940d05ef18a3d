"""The API's response_format as a grammar the engine holds the answer to (daemon/engine/grammar.py).

`json_object` is any JSON object; `json_schema` is its schema. llguidance
compiles the schema here, at the door, so a schema it cannot follow is a 400
that stores nothing; the engine builds the per-answer matcher from the same
grammar string.

A schema is client input that costs CPU to compile: 10,000 optional
properties took 20 s and, compiled on the event loop, stalled every other
client's ping by 4 s. So (:func:`output_grammar`):

- a schema over :data:`MAX_SCHEMA_BYTES` is refused before any work;
- the compile and a dry run run on a worker thread, at most
  :data:`COMPILERS` at a time (an abandoned one still counts until it ends),
  within :data:`DEADLINE` seconds;
- the dry run builds a matcher over a byte-level vocabulary and walks the
  first :data:`DRY_STEPS` bytes of some answer, which finds what the grammar
  check alone does not: a grammar past llguidance's parser limits (a row of
  more than 2,000 Earley items, as an object of 500 optional properties
  makes right after its ``{``), and a schema no finite JSON satisfies (``$ref``
  cycles: no first byte is possible). A schema whose cycles need a few
  levels of an answer to show (a required property that is the schema
  itself) is found before, by schemaends.py.

Each is a 400 naming ``response_format.json_schema.schema``.
"""

from __future__ import annotations

import threading
from http import HTTPStatus
from typing import Any

import anyio

from .httpdoor import ApiError
from .openai_schema import JsonSchemaFormat, ResponseFormat
from .schemaends import has_finite_value

__all__ = ["COMPILERS", "DEADLINE", "DRY_STEPS", "MAX_SCHEMA_BYTES", "call_grammar", "compile_grammar",
           "output_grammar"]

# Whitespace as models write JSON (a newline and an indent between items), but at most 16 characters
# in a row: a model may not pad an answer with blanks until max_tokens runs out.
STYLE = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}
#: A forced tool call's: one way to write it, `{"name": "f", "arguments": {...}}` (the model spends no token on
#: layout, and an answer read as a call has nothing but the call in it).
COMPACT = {"whitespace_flexible": False}

#: Largest schema accepted, as compact JSON. OpenAI's own structured outputs stop at 5,000 properties
#: and 120,000 characters of names; past ~500 optional properties llguidance's parser cannot hold the
#: answer anyway. 64 KiB compiles and dry-runs in about 0.2-1 s (bench numbers in docs/openai.md).
MAX_SCHEMA_BYTES = 64 * 1024
#: Seconds a schema may take to compile and dry-run before the request is refused.
DEADLINE = 5.0
#: Schemas compiled at once; a request past them waits (within its deadline).
COMPILERS = 2
#: Bytes of an answer the dry run walks: past the first ``{`` and a key or two.
DRY_STEPS = 16

_compilers = threading.BoundedSemaphore(COMPILERS)
_NO_END = ("no finite JSON satisfies this schema (its $refs, allOf or required properties only lead back to "
           "each other); give every reference a way to end")


class _Unfollowable(Exception):
    """The schema compiled but cannot hold an answer; the message says why."""


async def output_grammar(fmt: ResponseFormat | None, *, compact: bool = False) -> str | None:
    """llguidance's grammar for the format; None for plain text. An ApiError when it cannot be followed."""
    if fmt is None or fmt.type == "text":
        return None
    schema: dict[str, Any] | bool
    if fmt.type == "json_object":
        schema, strict, param = {"type": "object"}, True, "response_format"
    else:
        spec = fmt.json_schema
        if spec is None:
            raise ApiError(HTTPStatus.BAD_REQUEST, "response_format of type \"json_schema\" needs json_schema "
                           "(its name and schema)", param="response_format.json_schema")
        # No schema: any JSON value. Not strict: keywords llguidance does not implement are ignored.
        schema, strict, param = spec.schema_ or {}, bool(spec.strict), "response_format.json_schema.schema"
    size = await anyio.to_thread.run_sync(_size, schema)
    if size > MAX_SCHEMA_BYTES:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"the schema is more than kvd compiles ({MAX_SCHEMA_BYTES:,} "
                       "bytes as JSON); send a smaller one", param=param)
    with anyio.move_on_after(DEADLINE) as scope:
        try:
            return await anyio.to_thread.run_sync(compile_grammar, schema, strict, DEADLINE, compact,
                                                  abandon_on_cancel=True)
        except ValueError as e:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"the schema cannot be read: {_first(str(e))}",
                           param=param) from None
        except _Unfollowable as e:
            raise ApiError(HTTPStatus.BAD_REQUEST, str(e), param=param) from None
    assert scope.cancel_called
    raise ApiError(HTTPStatus.BAD_REQUEST, f"the schema did not compile within {DEADLINE:g} s; send a simpler "
                   "one", param=param)


async def call_grammar(tools: list[dict[str, Any]], name: str | None) -> str:
    """The grammar of one call of `tools` (of the function `name`): a forced tool call (forcedcall.py); an
    ApiError naming `tools` when their schemas cannot be followed."""
    from .forcedcall import call_schema

    fmt = ResponseFormat.model_construct(type="json_schema", json_schema=JsonSchemaFormat.model_construct(
        name="call", schema_=call_schema(tools, name), strict=False))
    try:
        grammar = await output_grammar(fmt, compact=True)
    except ApiError as e:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"tools: a call of them cannot be forced: {e.message}",
                       param="tools") from None
    assert grammar is not None
    return grammar


def _size(schema: Any, limit: int = MAX_SCHEMA_BYTES) -> int:
    """About the schema's size as compact JSON, counted up to just past `limit` (worker thread).

    A walk in Python, not ``json.dumps``: the C encoder holds the GIL for the
    whole dump (90 ms for 10,000 properties on a busy machine), and the event
    loop would wait for it; this hands the GIL back and stops at the limit.
    """
    size, todo = 0, [schema]
    while todo and size <= limit:
        item = todo.pop()
        if isinstance(item, dict):
            size += 2 + len(item)
            for key, value in item.items():
                size += len(str(key)) + 3
                todo.append(value)
        elif isinstance(item, list):
            size += 2 + len(item)
            todo.extend(item)
        else:
            size += len(item) + 2 if isinstance(item, str) else len(repr(item))
    return size


def _first(text: str) -> str:
    lines = text.strip().splitlines()
    return (lines[0] if lines else text)[:300]


def compile_grammar(schema: dict[str, Any] | bool, strict: bool, wait: float = DEADLINE, compact: bool = False) -> str:
    """The grammar for `schema`, dry-run (worker thread). ValueError: unreadable; _Unfollowable: see module."""
    from llguidance import LLMatcher

    if not _compilers.acquire(timeout=wait):
        raise _Unfollowable(f"kvd is busy compiling other schemas; none finished within {wait:g} s, retry")
    try:
        if not has_finite_value(schema):
            raise _Unfollowable(_NO_END)
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT if compact else STYLE,  # type: ignore[arg-type]
                                                     overrides={"lenient": not strict})
        _dry_run(grammar)
        return grammar
    finally:
        _compilers.release()


class _Bytes:
    """A vocabulary of the 256 bytes and an end token, for llguidance's TokenizerWrapper."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


_byte_view: Any = None
_BLANKS = [0x09, 0x0A, 0x0D, 0x20]


def _bytes_view() -> Any:
    global _byte_view
    if _byte_view is None:
        from llguidance import LLTokenizer, TokenizerWrapper

        _byte_view = LLTokenizer(TokenizerWrapper(_Bytes()), slices=[])
    return _byte_view


def _dry_run(grammar: str) -> None:
    """Walk the first bytes of some answer the grammar allows; _Unfollowable if the matcher fails on the way."""
    import numpy as np
    from llguidance import LLMatcher

    matcher = LLMatcher(_bytes_view(), grammar, log_level=0)  # drops the GIL while it builds
    for step in range(DRY_STEPS):
        bits = matcher.compute_bitmask()
        if matcher.is_error():
            break
        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")[:257])
        if allowed.size == 0 or (step == 0 and allowed.tolist() == [256]):
            raise _Unfollowable(_NO_END)
        if allowed[0] == 256 and allowed.size == 1:
            return  # a whole value
        solid = allowed[~np.isin(allowed, _BLANKS)]  # a blank leads nowhere new
        matcher.consume_token(int(solid[0] if solid.size else allowed[0]))
        if matcher.is_error():
            break
    if matcher.is_error():
        error = _first(matcher.get_error())
        if "NoExtensionBias" in error or "no possible" in error.lower():
            raise _Unfollowable(_NO_END)
        raise _Unfollowable(f"kvd cannot hold an answer to this schema: {error}")
