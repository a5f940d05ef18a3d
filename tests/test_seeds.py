"""A seeded sampled answer through the official `openai` client: the same alone and beside three others.

Each turn draws with its own key per answer position (daemon/engine/draws.py), never from
MLX's global random state, so neither other sessions' draws in the same batch nor the
draft tokens speculation verifies (on by default) change what a seed gives.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from conftest import running_daemon

pytestmark = pytest.mark.anyio

ASK: Any = [{"role": "user", "content": "Tell me about the sea, the sky and the hills."}]


async def test_a_seeded_answer_is_the_same_alone_and_beside_three_others(tmp_path: Path) -> None:
    import openai

    async with running_daemon(tmp_path) as d:
        api = openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token, max_retries=0)

        async def ask(seed: int | None, content: str = "") -> str:
            messages: Any = ASK if not content else [{"role": "user", "content": content}]
            r = await api.chat.completions.create(model="builtin:tiny", messages=messages, max_tokens=32,
                                                  temperature=0.8, seed=seed)
            return r.choices[0].message.content or ""

        alone = await ask(7)
        together = await asyncio.gather(ask(7), ask(None, "Hello there."), ask(3, "One two three four."),
                                        ask(None, "A longer question about many different things, please."))
        other = await ask(8)
        await api.close()
    assert alone and together[0] == alone
    assert other != alone  # the test can fail: another seed draws another answer


KNOBS: list[dict[str, Any]] = [
    {"temperature": 0.0, "frequency_penalty": 1.5, "logit_bias": {"7": 3.0}},
    {"temperature": 0.9, "seed": 11, "extra_body": {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3}},
    {"temperature": 0.9, "seed": 12, "presence_penalty": 1.0, "logprobs": True, "top_logprobs": 3},
]


@pytest.mark.parametrize("knobs", KNOBS, ids=["greedy penalised", "seeded top_k min_p repetition", "logprobs"])
async def test_answers_with_knobs_are_the_same_alone_and_batched(tmp_path: Path, knobs: dict[str, Any]) -> None:
    """The sampling knobs (engine/processing.py, draws.py) and logprobs act per row: an answer that sets them
    is the same, token and log-probability, alone and beside three others that set none or others."""
    import openai

    async with running_daemon(tmp_path) as d:
        api = openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token, max_retries=0)

        async def ask(content: str, **kw: Any) -> Any:
            r = await api.chat.completions.create(model="builtin:tiny", messages=[{"role": "user", "content": content}],
                                                  max_tokens=24, **kw)
            return r.choices[0]

        plain = await ask(ASK[0]["content"], temperature=0.0)
        alone = await ask(ASK[0]["content"], **knobs)
        together = await asyncio.gather(ask(ASK[0]["content"], **knobs), ask("Hello there.", temperature=0.7),
                                        ask("One two three four.", temperature=0.0, seed=3),
                                        ask("Many different things, please.", **KNOBS[(KNOBS.index(knobs) + 1) % 3]))
        await api.close()
    assert together[0].message.content == alone.message.content
    if "logprobs" in knobs:
        assert alone.logprobs is not None and together[0].logprobs is not None
        # The same tokens; their values as a batch of four computes them (its rows padded), within float error.
        assert [t.token for t in alone.logprobs.content] == [t.token for t in together[0].logprobs.content]
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(alone.logprobs.content,
                                                                      together[0].logprobs.content))
        assert all(len(t.top_logprobs) == 3 for t in alone.logprobs.content)
    else:
        assert alone.message.content != plain.message.content  # the knobs changed the answer: the test can fail
