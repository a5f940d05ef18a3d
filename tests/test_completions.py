"""POST /v1/completions through the official `openai` client on a real daemon (builtin:tiny): echo and
logprobs equal an in-process mlx-lm forward of the same model; a repeated long prompt reports its prefix
cached; token-id prompts, streaming, stop, seed, suffix; refusals that store nothing."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import openai
import pytest

from conftest import client, running_daemon

pytestmark = pytest.mark.anyio

MODEL = "builtin:tiny"
PROMPT = "The capital of France is"
LONG = " ".join(f"Rule {i}: answer in plain words and keep every promise made earlier." for i in range(40))


def api_of(d: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token, max_retries=0)


def reference(model_dir: Path, text: str, n: int) -> tuple[list[int], list[int], list[list[float]]]:
    """mlx-lm in this process, on the model kvd serves: the prompt's ids, its greedy continuation, and the
    log-softmax at every position of one forward over both (call with no daemon running)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    from daemon.engine import attention

    loaded: Any = load(str(model_dir))
    model, tokenizer = loaded[0], loaded[1]
    model.set_dtype(mx.float32)
    attention.install()
    ids = list(tokenizer.encode(text))
    answer = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]
    logits = model(mx.array(ids + answer)[None])[0]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return ids, answer, logprobs.tolist()


async def test_echo_and_logprobs_equal_an_mlx_lm_forward(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d):
            pass  # ready
        api = api_of(d)
        made = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
                                            logprobs=5)
        await api.close()
    ids, answer, logprobs = reference(tmp_path / "models" / "tiny", PROMPT, 8)
    got = made.choices[0].logprobs
    assert got is not None and got.tokens is not None and got.token_logprobs is not None
    assert got.top_logprobs is not None
    assert len(got.tokens) == len(ids) + len(answer)
    whole = ids + answer
    assert got.token_logprobs[0] is None  # nothing predicts the first token
    worst = 0.0
    for i in range(1, len(whole)):
        expected = logprobs[i - 1][whole[i]]
        worst = max(worst, abs(got.token_logprobs[i] - expected))
        top = got.top_logprobs[i]
        assert top is not None and len(top) == 5
        best = sorted(logprobs[i - 1], reverse=True)[:5]
        assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(sorted(top.values(), reverse=True), best))
    print(f"largest difference from mlx-lm's forward: {worst:.2e}")
    assert worst <= 1e-3
    text = made.choices[0].text
    assert text.startswith(PROMPT) and "".join(got.tokens) == text
    assert made.usage is not None and made.usage.completion_tokens == len(answer)


async def test_a_repeated_long_prompt_reports_its_prefix_cached(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        api = api_of(d)
        first = await api.completions.create(model=MODEL, prompt=LONG + " First.", max_tokens=4, temperature=0)
        again = await api.completions.create(model=MODEL, prompt=LONG + " Second.", max_tokens=4, temperature=0)
        same = await api.completions.create(model=MODEL, prompt=LONG + " First.", max_tokens=4, temperature=0)
        ids = await api.completions.create(model=MODEL, prompt=[5, 6, 7, 8, 9, 10], max_tokens=3, temperature=0)
        await api.close()
        sessions = d.store.list_sessions()
    assert first.usage is not None and again.usage is not None and same.usage is not None
    assert first.usage.prompt_tokens_details is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens or 0
    print(f"a repeated prefix: {cached} of {again.usage.prompt_tokens} prompt tokens cached")
    assert cached >= 0.9 * again.usage.prompt_tokens
    assert same.choices[0].text == first.choices[0].text  # greedy, restored: the same continuation
    assert ids.usage is not None and ids.usage.prompt_tokens == 6
    assert len(sessions) <= 2  # completions run in a few pooled sessions, not one each


async def test_stream_stop_seed_and_refusals(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        api = api_of(d)
        whole = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        stream = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                              stream_options={"include_usage": True})
        parts = [c async for c in stream]
        assert "".join(c.choices[0].text for c in parts if c.choices) == whole.choices[0].text
        assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 12
        text = whole.choices[0].text
        stop = text.strip().split()[1] if len(text.split()) > 1 else text[2:4]
        cut = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
        assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
        seeded = [await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7)
                  for _ in range(2)]
        assert seeded[0].choices[0].text == seeded[1].choices[0].text
        before = d.store.list_sessions()
        refusals: list[tuple[dict[str, Any], str | None]] = [
            ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [10**9]}, "prompt"),
            ({"prompt": PROMPT, "suffix": "x"}, "suffix"), ({"prompt": PROMPT, "best_of": 3}, "best_of"),
            ({"prompt": PROMPT, "logprobs": 50}, None), ({"prompt": PROMPT, "max_tokens": "5"}, None),
            ({"prompt": {"a": 1}}, None)]
        for ask, param in refusals:
            with pytest.raises(openai.BadRequestError) as refused:
                await api.completions.create(model=MODEL, **ask)
            if param is not None:
                assert refused.value.param == param, refused.value
        assert d.store.list_sessions() == before
        await api.close()


async def test_completions_at_once_each_take_their_own_pooled_session(tmp_path: Path) -> None:
    import asyncio

    async with running_daemon(tmp_path) as d:
        api = api_of(d)
        made = await asyncio.gather(*(api.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=4,
                                                             temperature=0) for i in range(4)))
        again = await asyncio.gather(*(api.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=4,
                                                              temperature=0) for i in range(4)))
        await api.close()
        sessions = d.store.list_sessions()
    assert [m.choices[0].text for m in made] == [a.choices[0].text for a in again]  # greedy: as before
    assert len(sessions) <= 4  # the second round reused the first's sessions


async def test_malformed_huge_and_nested_bodies_are_4xx_that_store_nothing(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    import json
    import logging

    import httpx

    caplog.set_level(logging.INFO)
    deep = b'{"y": ' * 300 + b"1" + b"}" * 300
    ok = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).encode()
    bodies = [(b"{nope", 400), (b"[" * 100_000 + b"]" * 100_000, 400), (b"[1, 2]", 400),
              (ok[:-1] + b', "extra": ' + deep + b"}", 400), (ok[:-1] + b', "prompt": ' + deep + b"}", 400),
              (b'{"prompt": "a\\ud800b"}', 400), (json.dumps({"prompt": "x" * 1_100_000}).encode(), 413),
              (json.dumps({"prompt": list(range(5)) * 300_000}).encode(), 413), (b'{"prompt": 5}', 400)]
    async with running_daemon(tmp_path) as d:
        before = d.store.list_sessions()
        async with httpx.AsyncClient(base_url=d.url.replace("ws://", "http://"), timeout=60,
                                     headers={"Authorization": f"Bearer {d.token}"}) as http:
            for body, status in bodies:
                r = await http.post("completions", content=body, headers={"Content-Type": "application/json"})
                assert r.status_code == status, (body[:40], r.text[:200])
                assert r.json()["error"]["message"]
            assert d.store.list_sessions() == before
            assert (await http.post("completions", content=ok, headers={"Content-Type": "application/json"})
                    ).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def test_a_prompt_past_the_context_is_refused_and_the_log_says_why(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The engine's refusal (the prompt does not fit the model's context) comes after the turn started: still a
    400 that stores nothing, and the log's refusal line gives the reason the client got."""
    import logging

    caplog.set_level(logging.INFO)
    async with running_daemon(tmp_path) as d:
        api = api_of(d)
        before = d.store.list_sessions()
        with pytest.raises(openai.BadRequestError) as refused:
            await api.completions.create(model=MODEL, prompt="x " * 15_500, max_tokens=4)
        assert refused.value.code == "context_length_exceeded"
        assert d.store.list_sessions() == before
        await api.close()
    said = [r.getMessage() for r in caplog.records if "POST /v1/completions" in r.getMessage()]
    assert said and "context_length_exceeded" in said[0] and "(no reason given)" not in said[0], said
