"""Shared fixtures: a real kvd daemon in-process on port 0, a raw websocket client.

OpenBLAS is interposed here, before anything imports mlx.core, exactly as
`kvd serve` does, so the in-process tests run at the speed users see.
"""

from __future__ import annotations

from daemon.service.blas import preload_blas

preload_blas()

import asyncio  # noqa: E402
import base64  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
from collections.abc import AsyncIterator  # noqa: E402
from contextlib import asynccontextmanager  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import anyio  # noqa: E402
import pytest  # noqa: E402
from websockets.asyncio.client import ClientConnection, connect  # noqa: E402

from daemon.cli import ensure_token  # noqa: E402
from daemon.config import Config, load_config  # noqa: E402
from daemon.engine.thread import Engine  # noqa: E402
from daemon.server import Daemon  # noqa: E402
from sessions import Store  # noqa: E402

EVENT_TIMEOUT = 60.0  # generous bound on any single event; tests never sleep


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# The suite's tiers, one table: every test module is in exactly one. `make check` runs the unit tier
# (no daemon, no process, no model: the inner loop); `make test` runs them all.
#   unit        - objects in this process: stores, caches, parsers, policies (MLX arrays allowed)
#   integration - a real daemon in this process (builtin:tiny) with real websocket/HTTP clients
#   e2e         - real `kvd serve` processes, tmux, the real model, kill -9, the BLAS probe
TIERS: dict[str, frozenset[str]] = {
    "unit": frozenset({
        "test_api_cores", "test_arrows", "test_names", "test_attention", "test_builtin", "test_config", "test_cost",
        "test_direct",
        "test_durable", "test_cli", "test_complexity", "test_device", "test_lockstep", "test_private_surfaces",
        "test_server_socket", "test_door_events",
        "test_gguf", "test_ggufarch", "test_ggufspm", "test_ioworker", "test_lru", "test_scheduler",
        "test_segment_compat", "test_segments", "test_shapes", "test_snapshot", "test_store", "test_store_tiers",
        "test_table", "test_transcript_writer", "test_tui_render", "test_wire", "test_writeback_plan",
        "test_prune_paths", "test_schemaends", "test_admission", "test_renders", "test_terminal_modes",
        "test_render_templates", "test_logfile", "test_anthropic_shapes", "test_responses_unit", "test_jsondepth",
        "test_pool", "test_shared_budgets", "test_ollama_rules", "test_architecture_doc", "test_checkpoints",
    }),
    "integration": frozenset({
        "test_attach", "test_bad_input", "test_concurrency", "test_e2e", "test_engine",
        "test_kvchat_commands", "test_kvchat_daily", "test_loading", "test_openai_http", "test_openai_json",
        "test_openai_tools",
        "test_packing", "test_quantized", "test_restore_admission", "test_resume", "test_security",
        "test_session_requests", "test_shared", "test_seeds", "test_choices",
        "test_speculate",
        "test_fed_checksum", "test_tool_turns", "test_prefill", "test_render_exact", "test_empty_answers",
        "test_models", "test_models_budgets", "test_responses", "test_memory", "test_door_rules", "test_metrics",
        "test_completions", "test_responses_rewrite",
    }),
    "e2e": frozenset({
        "test_answer_stream", "test_attention_model", "test_blas", "test_disk_full", "test_gemma3", "test_gguf_fuzz",
        "test_heap",
        "test_distributed", "test_hostile_http", "test_index_rebuild", "test_kill9", "test_kvchat_daily_tmux",
        "test_kvchat_tmux", "test_docs_run",
        "test_missing_blocks", "test_mlx_backend", "test_model_places", "test_openai", "test_realmodel", "test_restart",
        "test_service_life", "test_start_failures", "test_startup", "test_transcript_crash",
        "test_transcript_integrity", "test_hostile_stores", "test_hostile_schemas", "test_models_e2e",
        "test_responses_restart", "test_model_loads",
        "test_anthropic", "test_hostile_messages", "test_ollama", "test_hostile_ollama", "test_forced_calls",
        "test_hybrid", "test_start_losses",
    }),
}  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its module's tier; a module in no tier is an error, not a silent default."""
    for item in items:
        module = item.path.stem
        tiers = [tier for tier, modules in TIERS.items() if module in modules]
        if len(tiers) != 1:
            raise pytest.UsageError(f"tests/{module}.py is in {len(tiers)} tiers: list it in exactly one "
                                    "of TIERS in tests/conftest.py")
        item.add_marker(getattr(pytest.mark, tiers[0]))


@dataclass
class RunningDaemon:
    url: str
    token: str
    config: Config
    store: Store
    daemon: Daemon

    def connect(self, **kwargs: Any) -> Any:
        headers = kwargs.pop("additional_headers", {"Authorization": f"Bearer {self.token}"})
        return connect(self.url, additional_headers=headers, **kwargs)


@asynccontextmanager
async def running_daemon(data_dir: Path, *, start_engine: bool = True,
                         **overrides: Any) -> AsyncIterator[RunningDaemon]:
    """A daemon serving on port 0. With start_engine=False it serves with the model not yet
    loading, until the test calls `d.daemon.engine.start()` (which it must, before leaving)."""
    overrides.setdefault("port", 0)
    overrides.setdefault("prefetch", False)  # a restart in a test is cold unless it asks otherwise
    overrides.setdefault("model", "builtin:tiny")  # the real default model is for a handful of tests
    config = load_config(None, data_dir=data_dir, **overrides)
    data_dir.mkdir(parents=True, exist_ok=True)
    token = ensure_token(data_dir)
    store = Store(config.db_path)
    engine = Engine(config)
    if start_engine:
        engine.start()
    daemon = Daemon(config, store, engine, token)
    try:
        async with anyio.create_task_group() as tg:
            url = await tg.start(daemon.run)
            yield RunningDaemon(url, token, config, store, daemon)
            daemon.shutdown()
    finally:
        store.close()


class Client:
    """A raw protocol client: frames in, frames out, nothing hidden."""

    def __init__(self, ws: ClientConnection):
        self.ws = ws
        self._n = 0

    async def recv(self) -> dict[str, Any]:
        with anyio.fail_after(EVENT_TIMEOUT):
            event: dict[str, Any] = json.loads(await self.ws.recv())
        return event

    async def send(self, frame: dict[str, Any] | str | bytes) -> None:
        await self.ws.send(frame if isinstance(frame, (str, bytes)) else json.dumps(frame))

    async def request(self, type: str, **fields: Any) -> dict[str, Any]:
        self._n += 1
        rid = f"r{self._n}"
        await self.send({"id": rid, "type": type, **fields})
        reply = await self.recv()
        assert reply["id"] == rid, reply
        return reply

    async def chat(self, session: str, text: str, **fields: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Send one chat turn; return its deltas and its closing event."""
        self._n += 1
        rid = f"r{self._n}"
        await self.send({"id": rid, "type": "chat.send", "session": session, "text": text, **fields})
        deltas: list[dict[str, Any]] = []
        while True:
            event = await self.recv()
            assert event["id"] == rid, event
            if event["type"] == "chat.delta":
                deltas.append(event)
            elif event["type"] in ("chat.done", "error"):
                return deltas, event
            else:  # a prefill of several chunks reports its progress (a window's stops at every block)
                assert event["type"] in ("chat.start", "chat.progress"), event


@asynccontextmanager
async def client(d: RunningDaemon) -> AsyncIterator[Client]:
    async with d.connect() as ws:
        c = Client(ws)
        hello = await c.recv()
        assert hello["type"] == "hello" and hello["protocol"] == 1
        if not hello["ready"]:
            await wait_ready(c)
        yield c


async def wait_ready(c: Client) -> list[dict[str, Any]]:
    """Read the `loading` events a daemon pushes while its model loads, up to `ready`; return them."""
    seen = []
    while (event := await c.recv())["type"] != "ready":
        assert event["type"] == "loading", event
        seen.append(event)
    return seen


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both built-in models, loaded through mlx-lm and cast to float32, once per test run."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from daemon.models.builtin import BUILTIN_NAMES, ensure_builtin

    root = tmp_path_factory.mktemp("models")
    out = {}
    for name in BUILTIN_NAMES:
        model = load(str(ensure_builtin(name, root)))[0]
        model.set_dtype(mx.float32)
        out[name] = model
    return out


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models dir holding the default model's fetched GGUF file and its converted mlx-lm dir."""
    from daemon.models.sources import DEFAULT_MODEL, prepare_model

    models = tmp_path_factory.mktemp("smollm2") / "models"
    prepare_model(DEFAULT_MODEL, models)
    return models


def converted(models: Path) -> Path:
    (path,) = (models / "gguf").glob("*-float32")
    return path


def greedy_reference(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """What a fresh full prefill of `prompt` continues with, outside the daemon (call with no daemon
    running): mlx-lm's own generate_step on the model as kvd runs it, kvd's CPU attention included
    (kvd's answers are compared with kvd's own; tests/test_attention_model.py compares kvd's
    attention with MLX's)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    from daemon.engine import attention

    model = load(str(model_dir))[0]
    model.set_dtype(mx.float32)
    attention.install()
    return [int(token) for token, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def fed_tokens(db_path: Path, session: str) -> list[int]:
    import sqlite3

    from common.tokenids import unpack_tokens

    db = sqlite3.connect(db_path)
    try:
        (blob,) = db.execute("SELECT tokens FROM session_tokens WHERE session_id = ?", [session]).fetchone()
    finally:
        db.close()
    return unpack_tokens(blob)


async def raw_client(url: str, token: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A websocket client on a socket with a tiny receive buffer that we control fully."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET /v1 HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                  f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {token}\r\n\r\n").encode())
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer
