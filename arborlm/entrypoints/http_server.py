"""The FastAPI app: routes, middlewares, error shapes, and the lifespan that
starts the `TokenizerManager` on uvicorn's event loop and stops the scheduler.

`create_app(state)` takes a `ServerState` whose scheduler process is already
running (`launch.py` starts it before uvicorn, so a model that fails to load
fails the command, not the first request).

The middlewares, outermost first: `RequestIdMiddleware` (every answer's
`X-Request-Id`), `BrowserGuardMiddleware` (Host and cross-site checks),
`BodyLimitMiddleware` (413), `AuthMiddleware` (bearer keys); docs/security.md
says what each refuses and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request

from arborlm.entrypoints import info_api, native_api
from arborlm.entrypoints.auth import AuthMiddleware, KeyPolicy
from arborlm.entrypoints.body_limit import BodyLimitMiddleware
from arborlm.entrypoints.browser_guard import BrowserGuardMiddleware, HostPolicy
from arborlm.entrypoints.http_errors import install_error_handlers
from arborlm.entrypoints.openai.response_store import ResponseStore
from arborlm.entrypoints.openai.serving_chat import chat_completions
from arborlm.entrypoints.openai.serving_completions import completions
from arborlm.entrypoints.openai.serving_embeddings import router as embeddings_router
from arborlm.entrypoints.openai.serving_responses import router as responses_router
from arborlm.entrypoints.request_id import RequestIdMiddleware
from arborlm.entrypoints.server_state import ServerState, get_state
from arborlm.runtime.launcher import close_front
from arborlm.runtime.tokenizer_manager import TokenizerManager
from arborlm.version import __version__

logger = logging.getLogger(__name__)


def create_app(state: ServerState) -> FastAPI:
    """The server's app around `state` (settings, model facts, the running scheduler
    process, the metrics). If the scheduler dies while serving, every waiting request
    fails with 503 and `manager.dead_reason` is set (the launcher then stops)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await _start_front(state)
        try:
            yield
        finally:
            await _stop_front(state)

    app = FastAPI(title="arborlm", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.arbor = state
    app.state.responses = ResponseStore()  # /v1/responses with store: true
    install_error_handlers(app)
    _install_middlewares(app, state)
    app.include_router(native_api.router)
    app.include_router(info_api.router)
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.include_router(responses_router)
    app.include_router(embeddings_router)
    return app


async def _start_front(state: ServerState) -> None:
    """Build the tokenizer manager on this (uvicorn's) loop and watch the scheduler."""
    manager = TokenizerManager(state.server_args, state.model_info, state.tokenizer,
                               state.scheduler.port_args, observer=state.metrics)
    manager.start()
    state.manager = manager
    loop = asyncio.get_running_loop()
    state.scheduler.watch(lambda reason: loop.call_soon_threadsafe(manager.fail_all, reason))


async def _stop_front(state: ServerState) -> None:
    """Fail what is still in flight, stop the scheduler process and close the sockets."""
    state.shutting_down = True
    state.scheduler.begin_stop()
    if state.manager is not None:
        state.manager.abort_all("the server is shutting down")
        await close_front(state.manager)
    await asyncio.to_thread(state.scheduler.stop)
    logger.info("scheduler stopped")


def _install_middlewares(app: FastAPI, state: ServerState) -> None:
    """Each `add_middleware` wraps the ones before it: the last added runs first."""
    cfg = state.server_args.server
    app.add_middleware(AuthMiddleware, policy=KeyPolicy(cfg.api_key, cfg.admin_api_key))
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_request_bytes)
    app.add_middleware(BrowserGuardMiddleware, policy=HostPolicy(cfg.allowed_hosts, cfg.binds_loopback))
    app.add_middleware(RequestIdMiddleware)


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "arborlm",
            "root": state.model_name, "max_model_len": state.model_info.context_length}


async def list_models(request: Request) -> dict:
    """OpenAI's `GET /v1/models`: the one model this server serves."""
    return {"object": "list", "data": [_model_card(get_state(request))]}


async def retrieve_model(request: Request, model_id: str) -> dict:
    """OpenAI's `GET /v1/models/{id}`; 404 `model_not_found` for another model."""
    state = get_state(request)
    state.check_model(model_id)
    return _model_card(state)
