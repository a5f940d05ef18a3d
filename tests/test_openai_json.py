"""JSON output through the official `openai` client: response_format json_schema and json_object,
held by llguidance's token masks inside kvd's batched decode (daemon/engine/grammar.py), on a real
daemon serving builtin:tiny (random weights: left alone it writes no JSON at all)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from conftest import running_daemon

pytestmark = pytest.mark.anyio

# A finite language: every answer ends, whatever the weights, once the object is whole.
ORDER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "size": {"enum": ["small", "medium", "large"]},
        "hot": {"type": "boolean"},
        "extras": {"type": "array", "items": {"enum": ["milk", "sugar"]}, "maxItems": 2},
    },
    "required": ["size", "hot", "extras"],
    "additionalProperties": False,
}
FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER, "strict": True}}
ASK: Any = [{"role": "user", "content": "A coffee, please, as JSON."}]


def api_of(d: Any) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token, max_retries=0)


async def test_json_schema_answers_validate_greedy_sampled_and_streamed(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        api = api_of(d)
        plain = await api.chat.completions.create(model="builtin:tiny", messages=ASK, max_tokens=40, temperature=0)
        assert plain.choices[0].message.content is not None
        with pytest.raises(json.JSONDecodeError):  # the model alone writes no JSON: the masks do
            json.loads(plain.choices[0].message.content)
        answers = []
        for temperature, seed in [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)]:
            r = await api.chat.completions.create(model="builtin:tiny", messages=ASK, max_tokens=200,
                                                  temperature=temperature, seed=seed, response_format=FORMAT)
            assert r.choices[0].finish_reason == "stop"  # the object closed, then only an end of turn
            answers.append(json.loads(r.choices[0].message.content or ""))
        stream = await api.chat.completions.create(model="builtin:tiny", messages=ASK, max_tokens=200, temperature=0,
                                                   response_format=FORMAT, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await api.close()
    for answer in answers:
        jsonschema.validate(answer, ORDER)
    assert json.loads(text) == answers[0]  # streamed, greedy: the same answer
    assert len({json.dumps(a) for a in answers[1:]}) > 1  # sampled: the seeds give different orders


async def test_json_object_and_a_plain_session_beside_it_in_one_batch(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, max_generations=4) as d:
        api = api_of(d)
        alone = await api.chat.completions.create(model="builtin:tiny", messages=ASK, max_tokens=24, temperature=0)
        plain, shaped = await asyncio.gather(
            api.chat.completions.create(model="builtin:tiny", messages=ASK, max_tokens=24, temperature=0),
            api.chat.completions.create(model="builtin:tiny", messages=[{"role": "user", "content": "Any object."}],
                                        max_tokens=120, temperature=0, response_format={"type": "json_object"}))
        await api.close()
    # The unconstrained answer decoded in the same batch is the one it gives alone, token for token.
    assert plain.choices[0].message.content == alone.choices[0].message.content
    text = shaped.choices[0].message.content or ""
    assert text.startswith("{")
    if shaped.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # max_tokens cut it: what there is must still be the start of an object, never anything else
        assert shaped.choices[0].finish_reason == "length"
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


@pytest.mark.parametrize(("fmt", "says", "param"), [
    ({"type": "json_schema"}, "needs json_schema", "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
     "cannot hold an answer", "response_format.json_schema.schema"),
    ({"type": "yaml"}, "response_format.type", "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": True,  # strict: no keyword ignored
                                             "schema": {"type": "string", "not": {"const": "a"}}}},
     'Unimplemented keys: ["not"]', "response_format.json_schema.schema"),
])
async def test_a_format_kvd_cannot_follow_is_refused_and_stores_nothing(
        tmp_path: Path, fmt: Any, says: str, param: str) -> None:
    import openai

    async with running_daemon(tmp_path) as d:
        api = api_of(d)
        with pytest.raises(openai.BadRequestError) as e:
            await api.chat.completions.create(model="builtin:tiny", messages=ASK, max_tokens=8, response_format=fmt)
        await api.close()
        assert says in e.value.message and e.value.param == param
        assert d.store.list_sessions() == []


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_that_leaves_its_grammar_is_an_error_never_a_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    """A grammar the door's dry run passes but the engine's matcher cannot hold (here: the dry run is
    switched off, and 600 optional properties overflow llguidance's parser row after the ``{``)."""
    import openai

    from daemon.doors import jsonoutput

    monkeypatch.setattr(jsonoutput, "_dry_run", lambda grammar: None)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "wide", "schema": wide}}
    async with running_daemon(tmp_path) as d:
        api = api_of(d)
        with pytest.raises(openai.APIError) as e:
            if stream:
                chunks = await api.chat.completions.create(model="builtin:tiny", messages=ASK, max_tokens=40,
                                                           temperature=0, response_format=fmt, stream=True)
                async for chunk in chunks:
                    assert not chunk.choices or chunk.choices[0].finish_reason is None, chunk
            else:
                await api.chat.completions.create(model="builtin:tiny", messages=ASK, max_tokens=40,
                                                  temperature=0, response_format=fmt)
        await api.close()
        assert "could not be held to its response_format" in e.value.message
        (session,) = d.store.list_sessions()
        answers = [m for m in d.store.messages(session["id"]) if m["role"] == "assistant"]
    assert [(m["status"], m["finish_reason"]) for m in answers] == [("error", "error")]
