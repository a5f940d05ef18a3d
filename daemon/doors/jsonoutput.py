"""The API's response_format as a grammar the engine holds the answer to (daemon/engine/grammar.py).

`json_object` is any JSON object; `json_schema` is its schema. llguidance
compiles the schema here, at the door, so a schema it cannot follow is a 400
that stores nothing; the engine builds the per-answer matcher from the same
grammar string.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from .openai_schema import ApiError, ResponseFormat

# Whitespace as models write JSON (a newline and an indent between items), but at most 16 characters
# in a row: a model may not pad an answer with blanks until max_tokens runs out.
STYLE = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}


def output_grammar(fmt: ResponseFormat | None) -> str | None:
    """llguidance's grammar for the format; None for plain text. An ApiError when it cannot be followed."""
    from llguidance import LLMatcher

    if fmt is None or fmt.type == "text":
        return None
    schema: dict[str, Any]
    if fmt.type == "json_object":
        schema, strict, param = {"type": "object"}, True, "response_format"
    else:
        spec = fmt.json_schema
        if spec is None:
            raise ApiError(HTTPStatus.BAD_REQUEST, "response_format of type \"json_schema\" needs json_schema "
                           "(its name and schema)", param="response_format.json_schema")
        # No schema: any JSON value. Not strict: keywords llguidance does not implement are ignored.
        schema, strict, param = spec.schema_ or {}, bool(spec.strict), "response_format.json_schema.schema"
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=STYLE,  # type: ignore[arg-type]
                                                     overrides={"lenient": not strict})
    except ValueError as e:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"the schema cannot be read: {e}", param=param) from None
    if error := LLMatcher.validate_grammar(grammar):
        first = error.strip().splitlines()[0] if error.strip() else error
        raise ApiError(HTTPStatus.BAD_REQUEST, f"kvd cannot hold an answer to this schema: {first[:300]}",
                       param=param)
    return grammar
