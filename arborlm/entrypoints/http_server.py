"""The FastAPI app: routes, bearer-key check, error shapes, and the lifespan that
starts the `TokenizerManager` on uvicorn's event loop and stops the scheduler.

`create_app(state)` takes a `ServerState` whose scheduler process is already
running (`launch.py` starts it before uvicorn, so a model that fails to load
fails the command, not the first request).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from arborlm.entrypoints import native_api
from arborlm.entrypoints.body_limit import BodyLimitMiddleware
from arborlm.entrypoints.http_errors import APIError, install_error_handlers
from arborlm.entrypoints.openai.serving_chat import chat_completions
from arborlm.entrypoints.openai.serving_completions import completions
from arborlm.entrypoints.server_state import ServerState, get_state
from arborlm.runtime.launcher import close_front
from arborlm.runtime.tokenizer_manager import TokenizerManager
from arborlm.version import __version__

logger = logging.getLogger(__name__)

# Open without the API key: liveness probes and metric scrapers carry no token (as in SGLang).
PUBLIC_PATHS = ("/health", "/metrics")


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
    install_error_handlers(app)
    _install_auth(app, state.server_args.server.api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.server_args.server.max_request_bytes)  # outermost
    app.include_router(native_api.router)
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
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


def _install_auth(app: FastAPI, api_key: str | None) -> None:
    """With `api_key`, every route but `PUBLIC_PATHS` needs `Authorization: Bearer <key>` (else 401)."""
    if not api_key:
        return

    @app.middleware("http")
    async def check_key(request: Request, call_next) -> Response:
        if request.method == "OPTIONS" or request.url.path in PUBLIC_PATHS:
            return await call_next(request)
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
            error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")
            return error.response()
        return await call_next(request)


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
