"""`launch_server`: bind the port, start the scheduler process, serve with uvicorn
until Ctrl-C or SIGTERM, then shut down cleanly.

Order of a clean shutdown: the first SIGINT/SIGTERM stops accepting
connections and aborts every in-flight request (non-streaming callers get a
503, streams an error event); uvicorn then waits for the handlers, and the app's
lifespan tells the scheduler process to exit, joins it and removes its IPC
folder; the listening socket is closed, so the port is free when the command
returns. A second Ctrl-C forces the exit.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Iterator

import uvicorn

from arborlm.entrypoints.http_server import create_app
from arborlm.entrypoints.metrics import ServerMetrics
from arborlm.entrypoints.server_state import ServerState, served_model_name
from arborlm.errors import EngineDeadError
from arborlm.runtime.config import ServerArgs
from arborlm.runtime.launcher import SchedulerProcess, launch_scheduler, load_tokenizer

logger = logging.getLogger("arborlm.server")

GRACEFUL_SHUTDOWN_TIMEOUT_S = 10


class _Server(uvicorn.Server):
    """uvicorn's server that aborts in-flight requests as shutdown begins, stops when
    the scheduler dies, and exits with status 0 after a signal (uvicorn re-raises
    the signal by default)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.arbor_state = state

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        """A signal begins the stop: a scheduler that the same SIGTERM killed (a cgroup kill)
        is then a clean stop, not a dead scheduler (exit 0)."""
        if self.arbor_state.scheduler is not None:
            self.arbor_state.scheduler.begin_stop()
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """Also stop when the scheduler process died (every waiting request has failed by then)."""
        manager = self.arbor_state.manager
        if manager is not None and manager.dead_reason is not None:
            logger.error("%s; stopping the server", manager.dead_reason)
            return True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        state = self.arbor_state
        state.shutting_down = True
        if state.manager is not None:
            state.manager.abort_all("the server is shutting down")
        await super().shutdown(sockets=sockets)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port).

    Raises
    ------
    OSError: the address is in use or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


def launch_server(server_args: ServerArgs) -> None:
    """Serve `server_args`' model over HTTP until a signal; blocks.

    Raises
    ------
    OSError: the port is taken (checked before the model loads).
    ModelLoadError, ValueError, EngineDeadError: the scheduler could not start.
    """
    cfg = server_args.server
    configure_logging(cfg.log_level)
    sock = bind_socket(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    try:
        with _sigterm_as_exit():
            logger.info("loading %s", server_args.model.model_path or "the default model (SmolLM2-135M-Instruct)")
            scheduler = launch_scheduler(server_args)
        try:
            _serve(server_args, scheduler, sock, host, port)
        finally:
            scheduler.begin_stop()
            scheduler.stop()  # already stopped by the lifespan unless startup failed
    finally:
        sock.close()
    logger.info("server stopped")


def _serve(server_args: ServerArgs, scheduler: SchedulerProcess, sock: socket.socket, host: str, port: int) -> None:
    info = scheduler.model_info
    name = served_model_name(server_args)
    state = ServerState(server_args=server_args, model_info=info, tokenizer=load_tokenizer(info, server_args.chat.chat_template),
                        scheduler=scheduler, metrics=ServerMetrics(name))
    config = uvicorn.Config(create_app(state), log_level=server_args.server.log_level, access_log=False,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_TIMEOUT_S, log_config=None)
    server = _Server(config, state)
    logger.info("model %s (%s, %s on %s): context %d tokens, KV pool %d tokens, max %d running requests",
                name, info.architecture, info.dtype, info.device, info.context_length,
                info.max_total_tokens, info.max_running_requests)
    logger.info("listening on http://%s:%d; ready when GET /health answers 200", _url_host(host), port)
    server.run(sockets=[sock])
    dead_reason = state.manager.dead_reason if state.manager is not None else None
    if dead_reason is not None:
        raise EngineDeadError(f"{dead_reason}; the server stopped")


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """While the model loads, SIGTERM exits through `finally` blocks (as Ctrl-C does)."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
