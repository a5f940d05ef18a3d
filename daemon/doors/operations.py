"""The operator's door: `GET /health` and `GET /metrics` (docs/operations.md).

- /health: 200 `{"status": "ok"}` once the default model is ready; 503 `{"status": "loading"}` while it
  loads, `{"status": "failed"}` if it could not be loaded (kvd's log says why). No token needed (a load
  balancer's or a supervisor's probe sends none), nothing else in it: no model, no path, no session. Its
  503 is an answer, not a refusal: counted in /metrics, not logged (a failed load is logged once, by itself).
- /metrics: Prometheus text (metrics.py), behind the token unless [api] metrics_public says otherwise.

The Host and Origin checks apply to both, as to every request (guards.py).
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ..config import Config
from .apiturns import guarded
from .httpdoor import ANSWERED, ApiError
from .loading import LoadingWatch
from .metrics import CONTENT_TYPE, Metrics

PATHS = ("/health", "/metrics")


def is_operations(path: str) -> bool:
    return path in PATHS


class OperationsDoor:
    def __init__(self, config: Config, loading: LoadingWatch, metrics: Metrics, token: str,
                 refuse: Callable[[ApiError], Response]):
        self.loading, self.metrics = loading, metrics
        routes: list[BaseRoute] = [Route("/health", self.health, methods=["GET"]),  # and HEAD
                                   Route("/metrics", self.scrape, methods=["GET"])]
        self.app = guarded(routes, config, token, refuse, "/health and /metrics", door="operations")

    async def health(self, request: Request) -> Response:
        if self.loading.ready:
            return JSONResponse({"status": "ok"})
        status = "failed" if self.loading.failure is not None else "loading"
        request.scope[ANSWERED] = True  # a probe's answer, not a refusal: a supervisor polling it fills no log
        return JSONResponse({"status": status}, status_code=HTTPStatus.SERVICE_UNAVAILABLE)

    async def scrape(self, request: Request) -> Response:
        return Response(self.metrics.text(), media_type=CONTENT_TYPE)
