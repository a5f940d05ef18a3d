"""kvd's Prometheus metrics (GET /metrics, docs/operations.md), made with `prometheus_client`.

Counted as things happen, in one registry per daemon (never the library's global one: a test process runs
many daemons):

- every HTTP response and websocket handshake, by door and status (`kvd_http_requests_total`, and
  `kvd_http_errors_total` for the 4xx and 5xx), counted where the server sends the status (server.py);
- every finished turn (the turn core tells its watchers, turns.py): turns by model, door and finish;
  its prompt's tokens, those prefilled and those restored by the tier they came from (resident, warm,
  disk, shared, none); the tokens decoded; speculation's drafted and rejected tokens; the time to the first
  token and the mean time per output token after it (histograms); a failed turn by its error code.

Read when scraped, from what the engines already publish (their statistics, refreshed after every turn's
cache is kept) and the registry of loaded models: cache bytes by tier and model, what each tier let go
(evictions: a budget's or an idle time's demotions), the turns waiting, and the loaded models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.tiers import DISK, TIERS

from ..turn import Turn

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the text format every Prometheus scrapes
#: Seconds: from a resident turn on a GPU (milliseconds) to a long prefill on a 2-core CPU (a minute).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def door_of(path: str, websocket: bool = False) -> str:
    """A request's door as a label (a few values, never the client's path)."""
    if websocket:
        return "websocket"
    if path.startswith("/api/"):
        return "ollama"
    for prefix, door in (("/v1/chat/completions", "chat"), ("/v1/completions", "completions"),
                         ("/v1/responses", "responses"), ("/v1/messages", "messages"), ("/v1/models", "models"),
                         ("/v1/kvd/", "kvd"), ("/health", "health"), ("/metrics", "metrics")):
        if path == prefix or path.startswith(prefix + "/") or path.startswith(prefix + "?"):
            return door
    return "root" if path == "/" else "other"


def turn_door(turn: Turn) -> str:
    """The door a turn came through, as its log line names it ("ollama chat, new session": "ollama chat")."""
    return turn.door.split(",")[0].strip() or "websocket"


@dataclass(frozen=True)
class Live:
    """What the daemon holds now, for a scrape: each engine's published statistics by model, the loaded
    models (`Engines.loaded()`), the API requests admitted but not started."""

    engines: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    loaded: list[dict[str, Any]] = field(default_factory=list)
    admitted: int = 0


class _LiveCollector(Collector):
    def __init__(self, live: Callable[[], Live]):
        self.live = live

    def collect(self) -> Iterable[Metric]:
        now = self.live()
        cache = GaugeMetricFamily("kvd_cache_bytes", "Bytes of KV cache each tier holds, by model (disk: this "
                                  "model's files)", labels=["model", "tier"])
        budget = GaugeMetricFamily("kvd_cache_budget_bytes", "Each tier's byte budget (shared by every model)",
                                   labels=["tier"])
        evicted = CounterMetricFamily("kvd_cache_evictions", "Caches a tier let go (demoted by its budget or "
                                      "idle time; disk: dropped by its budget), by model", labels=["model", "tier"])
        sessions = GaugeMetricFamily("kvd_cache_sessions", "Sessions whose cache a tier holds, by model",
                                     labels=["model", "tier"])
        waiting = GaugeMetricFamily("kvd_queue_depth", "Turns waiting for the engine, by model; API requests "
                                    "admitted but not started under model \"\"", labels=["model"])
        running = GaugeMetricFamily("kvd_turns_running", "Turns prefilling or decoding, by model", labels=["model"])
        for model, stats in now.engines.items():
            tiers = stats.get("tiers") or {}
            for tier in TIERS:
                t = tiers.get(tier) or {}
                held = t.get("model_bytes", t.get("bytes")) if tier == DISK else t.get("bytes")
                cache.add_metric([model, tier], float(held or 0))
                evicted.add_metric([model, tier], float(t.get("page_outs") or 0))
                sessions.add_metric([model, tier], float(t.get("sessions") or 0))
            waiting.add_metric([model], float(stats.get("waiting") or 0))
            running.add_metric([model], float(stats.get("generating") or 0))
        first = next(iter(now.engines.values()), {})
        for tier in TIERS:
            t = (first.get("tiers") or {}).get(tier) or {}
            if t.get("budget") is not None:
                budget.add_metric([tier], float(t["budget"]))
        waiting.add_metric([""], float(now.admitted))
        loaded = GaugeMetricFamily("kvd_model_loaded", "1 for each model loaded or loading, by state",
                                   labels=["model", "state", "default"])
        weights = GaugeMetricFamily("kvd_model_weights_bytes", "Bytes of each loaded model's weights",
                                    labels=["model"])
        for m in now.loaded:
            loaded.add_metric([m["model"], m["state"], str(bool(m.get("default"))).lower()], 1.0)
            weights.add_metric([m["model"]], float(m.get("weights_bytes") or 0))
        count = GaugeMetricFamily("kvd_models_loaded", "Models loaded or loading")
        count.add_metric([], float(len(now.loaded)))
        return [cache, budget, evicted, sessions, waiting, running, loaded, weights, count]


class Metrics:
    """One daemon's metrics: counted by the server and the turn core, read by GET /metrics."""

    def __init__(self, live: Callable[[], Live] = Live) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvd_http_requests", "HTTP responses and websocket handshakes, by door and status",
                                ["door", "code"], registry=r)
        self.errors = Counter("kvd_http_errors", "HTTP responses with a 4xx or 5xx status, by door and status",
                              ["door", "code"], registry=r)
        self.turns = Counter("kvd_turns", "Turns answered, by model, door and finish reason",
                             ["model", "door", "finish"], registry=r)
        self.turn_errors = Counter("kvd_turn_errors", "Turns that failed or were refused once started, by model, "
                                   "door and error code", ["model", "door", "code"], registry=r)
        self.prompt = Counter("kvd_prompt_tokens", "Prompt tokens of the turns answered, by model", ["model"],
                              registry=r)
        self.prefilled = Counter("kvd_prefilled_tokens", "Prompt tokens the model read (prefilled), by model",
                                 ["model"], registry=r)
        self.restored = Counter("kvd_restored_tokens", "Prompt tokens restored from a cache instead of read, by "
                                "model and the tier they came from", ["model", "tier"], registry=r)
        self.decoded = Counter("kvd_decoded_tokens", "Answer tokens generated, by model", ["model"], registry=r)
        self.drafted = Counter("kvd_drafted_tokens", "Tokens speculative decoding guessed, by model", ["model"],
                               registry=r)
        self.rejected = Counter("kvd_rejected_draft_tokens", "Guessed tokens the model did not keep, by model",
                                ["model"], registry=r)
        self.ttft = Histogram("kvd_time_to_first_token_seconds", "From a turn's arrival at the engine to its "
                              "first token, by model", ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("kvd_time_per_output_token_seconds", "Each answer's mean time per token after its "
                              "first, by model", ["model"], buckets=TPOT_BUCKETS, registry=r)
        r.register(_LiveCollector(live))

    # --- counted as it happens ---

    def responded(self, door: str, status: int) -> None:
        self.requests.labels(door, str(status)).inc()
        if status >= 400:
            self.errors.labels(door, str(status)).inc()

    def done(self, turn: Turn, usage: Mapping[str, Any], reason: str) -> None:
        """A turn's figures, once it is committed (a turn core watcher)."""
        model, door = turn.model, turn_door(turn)
        self.turns.labels(model, door, reason).inc()
        prompt, cached = int(usage.get("prompt_tokens") or 0), int(usage.get("cached_tokens") or 0)
        self.prompt.labels(model).inc(prompt)
        self.prefilled.labels(model).inc(int(usage.get("prefill_tokens") or prompt - cached))
        self.restored.labels(model, str(usage.get("restored_from") or "none")).inc(cached)
        completion = int(usage.get("completion_tokens") or 0)
        self.decoded.labels(model).inc(completion)
        drafted, accepted = int(usage.get("drafted_tokens") or 0), int(usage.get("accepted_tokens") or 0)
        self.drafted.labels(model).inc(drafted)
        self.rejected.labels(model).inc(max(0, drafted - accepted))
        if (ttft := usage.get("ttft_ms")) is not None:
            self.ttft.labels(model).observe(float(ttft) / 1000)
        if (tps := usage.get("decode_tps")) and completion > 1:
            self.tpot.labels(model).observe(1.0 / float(tps))

    def failed(self, turn: Turn, code: str) -> None:
        self.turn_errors.labels(turn.model, turn_door(turn), code).inc()

    # --- read when scraped ---

    def text(self) -> bytes:
        return generate_latest(self.registry)
