"""GET /health and GET /metrics on a real daemon (docs/operations.md): /health says 503 while the model
loads and 200 once it is ready, without the token and with nothing private in it; /metrics parses with
`prometheus_client`'s own parser, needs the token, and its counters move by exactly one turn's figures
after one turn, whichever door it came through."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import client, running_daemon

pytestmark = pytest.mark.anyio

MODEL = "builtin:tiny"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, by name and labels (the library's parser: the format is what it reads)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(scrape: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return scrape.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_health_is_503_while_loading_then_200_without_a_token(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvd")
    async with running_daemon(tmp_path, start_engine=False) as d:
        base = d.url.replace("ws://", "http://").removesuffix("/v1")
        async with httpx.AsyncClient(base_url=base) as http:
            loading = await http.get("/health")
            assert (loading.status_code, loading.json()) == (503, {"status": "loading"})
            assert (await http.head("/health")).status_code == 503
            refused = await http.get("/health", headers={"Host": "attacker.example"})
            assert refused.status_code == 403  # the Host check still applies
            d.daemon.engine.start()
            async with client(d):
                pass  # ready
            ready = await http.get("/health")
            assert (ready.status_code, ready.json()) == (200, {"status": "ok"})
    # A probe's 503 is its answer, not a refusal: only the foreign Host is logged.
    said = [r.getMessage() for r in caplog.records if "/health" in r.getMessage()]
    assert len(said) == 1 and "HTTP 403" in said[0], said


async def test_metrics_move_by_exactly_one_turn(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        base = d.url.replace("ws://", "http://").removesuffix("/v1")
        auth = {"Authorization": f"Bearer {d.token}"}
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            assert (await http.get("/metrics")).status_code == 401  # behind the token
            async with client(d):
                pass  # ready
            before = samples((await http.get("/metrics", headers=auth)).text)
            r = await http.post("/v1/chat/completions", headers=auth, json={
                "model": MODEL, "messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 6,
                "temperature": 0})
            usage: dict[str, Any] = r.json()["usage"]
            kvd = r.json()["kvd"]
            scraped = await http.get("/metrics", headers=auth)
            after = samples(scraped.text)
        assert scraped.headers["content-type"].startswith("text/plain")

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("kvd_turns_total", model=MODEL, door="chat", finish=kvd["finish_reason"]) == 1
    assert moved("kvd_prompt_tokens_total", model=MODEL) == usage["prompt_tokens"]
    assert moved("kvd_prefilled_tokens_total", model=MODEL) == kvd["prefill_tokens"]
    tier = kvd["restored_from"]
    assert moved("kvd_restored_tokens_total", model=MODEL, tier=tier) == usage["prompt_tokens_details"][
        "cached_tokens"]
    assert moved("kvd_decoded_tokens_total", model=MODEL) == usage["completion_tokens"]
    assert moved("kvd_rejected_draft_tokens_total", model=MODEL) == kvd["drafted_tokens"] - kvd["accepted_tokens"]
    assert moved("kvd_time_to_first_token_seconds_count", model=MODEL) == 1
    assert moved("kvd_time_to_first_token_seconds_sum", model=MODEL) == pytest.approx(kvd["ttft_ms"] / 1000)
    assert moved("kvd_http_requests_total", door="chat", code="200") == 1
    assert moved("kvd_http_errors_total", door="metrics", code="401") == 0  # that one was before `before`
    assert value(after, "kvd_http_errors_total", door="metrics", code="401") == 1
    assert value(after, "kvd_models_loaded") == 1
    assert value(after, "kvd_model_loaded", model=MODEL, state="idle", default="true") == 1
    assert value(after, "kvd_cache_bytes", model=MODEL, tier="resident") > 0  # the turn's cache, kept
    assert value(after, "kvd_queue_depth", model=MODEL) == 0


async def test_metrics_without_the_token_where_the_config_says_so(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, metrics_public=True) as d:
        base = d.url.replace("ws://", "http://").removesuffix("/v1")
        async with httpx.AsyncClient(base_url=base) as http:
            r = await http.get("/metrics")
            assert r.status_code == 200 and "kvd_http_requests_total" in r.text
            assert (await http.get("/metrics", headers={"Origin": "https://evil.example"})).status_code == 403
