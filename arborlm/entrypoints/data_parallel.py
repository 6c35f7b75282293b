"""`arborlm serve --dp-size N`: N full workers on loopback behind SGLang's router.

Each worker is an ordinary `arborlm serve` (HTTP front, scheduler process, its own KV
pool and radix cache) on a free loopback port; `sglang-router` (PyPI `sglang-router`,
SGLang's Rust gateway) listens on the public host and port and sends each request to a
worker, by default to the one whose cache holds the longest prefix of it (`cache_aware`).
This is SGLang's own data-parallel layout (`python -m sglang_router.launch_server
--dp-size N`), with arborlm workers.

Each worker runs on its own slice of the cores (`cpu_binding`): N workers that each
spread their kernels over every core would wait on each other's threads.

Lifecycle: workers start first (the public port is checked free before any model loads);
the router starts once every worker answers `GET /health`, so no request meets a worker
that is still loading. A worker that dies is dropped by the router's health checks and
the others keep serving; the command stops when the router or every worker has died, or
on Ctrl-C/SIGTERM, which stops the router and then each worker cleanly (each aborts its
in-flight requests, see `launch_server`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import httpx

from arborlm.errors import ArborError, EngineDeadError
from arborlm.runtime.config import ServerArgs
from arborlm.runtime.cpu_binding import bound_to, describe, split_cpus

logger = logging.getLogger("arborlm.data_parallel")

WORKER_HOST = "127.0.0.1"
WORKER_START_TIMEOUT_S = 1800.0  # a large model loads for minutes; SGLang's router waits as long
STOP_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.5
# The router's health checks: a dead worker is dropped after this many failed checks this far apart.
HEALTH_CHECK_INTERVAL_S = 1
HEALTH_FAILURE_THRESHOLD = 2
# Its circuit breaker stays off: sglang-router 0.3.2 counts a worker's 4xx answers as failures,
# so a few bad requests (a client's own 400s) opened both workers' breakers and every client
# got 503 "no available workers" for the breaker's timeout. A dead worker is dropped by the
# health checks above instead (within about 2 s); requests the router sends it until then
# fail with a 5xx, where the breaker would have retried them on the other worker.
DISABLE_CIRCUIT_BREAKER = True


class RouterMissingError(ArborError):
    """`--dp-size` > 1 without the optional `sglang-router` package."""


@dataclass(frozen=True)
class WorkerSpec:
    """One data-parallel worker: its server args (loopback host, its own port) and URL."""

    rank: int
    server_args: ServerArgs

    @property
    def url(self) -> str:
        return f"http://{WORKER_HOST}:{self.server_args.server.port}"


def require_router() -> None:
    """Raises RouterMissingError (naming the install command) when `sglang_router` is not importable."""
    try:
        import sglang_router.launch_router  # noqa: F401
    except ImportError as e:
        raise RouterMissingError(
            f"--dp-size > 1 needs SGLang's router: pip install 'arborlm[router]' (or sglang-router) ({e})"
        ) from None


def worker_specs(server_args: ServerArgs, ports: list[int]) -> list[WorkerSpec]:
    """The workers' server args: the public settings, on loopback, one port each, dp_size 1.

    `random_seed` stays the same on every worker, so a seeded request gives the same
    output whichever worker the router picks.
    """
    return [WorkerSpec(rank, server_args.replace(host=WORKER_HOST, port=port, dp_size=1, allowed_hosts=None))
            for rank, port in enumerate(ports)]


def router_kwargs(server_args: ServerArgs, workers: list[WorkerSpec], metrics_port: int) -> dict[str, Any]:
    """`sglang_router.router_args.RouterArgs` fields for these workers and the public address.

    The router's own API key is the workers' key: it authorises its probes
    (`/server_info`, `/model_info`); clients' `Authorization` headers are passed on to
    the workers, which check them. The router's Prometheus exporter listens on
    `metrics_port` on loopback (its default, 29000, would clash between two servers).
    """
    cfg = server_args.server
    return {
        "prometheus_host": WORKER_HOST,
        "prometheus_port": metrics_port,
        "worker_urls": [w.url for w in workers],
        "host": cfg.host,
        "port": cfg.port,
        "policy": server_args.parallel.router_policy,
        "cache_threshold": server_args.parallel.router_cache_threshold,
        "balance_abs_threshold": server_args.parallel.router_balance_abs_threshold,
        "balance_rel_threshold": server_args.parallel.router_balance_rel_threshold,
        "api_key": cfg.api_key,
        "max_payload_size": cfg.max_request_bytes,
        "health_check_interval_secs": HEALTH_CHECK_INTERVAL_S,
        "health_failure_threshold": HEALTH_FAILURE_THRESHOLD,
        "disable_circuit_breaker": DISABLE_CIRCUIT_BREAKER,
        "log_level": {"debug": "debug", "info": "info", "warning": "warn"}.get(cfg.log_level, "error"),
    }


def free_loopback_ports(n: int) -> list[int]:
    """`n` distinct ports free on loopback now (bound and released together, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket()
            sock.bind((WORKER_HOST, 0))
            socks.append(sock)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def check_port_free(host: str, port: int) -> None:
    """Raises OSError when the public address cannot be bound (before any model loads)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))


def _run_worker(server_args: ServerArgs) -> None:
    """A worker process: an ordinary server (it handles SIGTERM/SIGINT itself)."""
    from arborlm.entrypoints.launch_server import launch_server

    launch_server(server_args)


def _run_router(kwargs: dict[str, Any]) -> None:
    """The router process: sglang-router's Rust gateway, in the foreground until a signal.

    Ctrl-C in a terminal reaches this process too (the whole process group): the gateway
    stops, and the KeyboardInterrupt it leaves is the expected way out, not a traceback."""
    from sglang_router.launch_router import launch_router
    from sglang_router.router_args import RouterArgs

    with contextlib.suppress(KeyboardInterrupt):
        launch_router(RouterArgs(**kwargs))


def launch_data_parallel(server_args: ServerArgs) -> None:
    """Serve with `parallel.dp_size` workers behind sglang-router; blocks until a signal.

    Raises
    ------
    RouterMissingError: `sglang-router` is not installed.
    OSError: the public port is taken.
    EngineDeadError: a worker failed to start (its log says why) or every worker died.
    """
    require_router()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise
    cfg = server_args.server
    check_port_free(cfg.host, cfg.port)
    ctx = mp.get_context("spawn")
    *ports, metrics_port = free_loopback_ports(server_args.parallel.dp_size + 1)
    workers = worker_specs(server_args, ports)
    cpu_slices = split_cpus(len(workers))
    procs: list[BaseProcess] = []
    with _stop_on_signals():
        try:
            for w, cpus in zip(workers, cpu_slices):
                proc = ctx.Process(target=_run_worker, args=(w.server_args,), name=f"arborlm-dp{w.rank}")
                with bound_to(cpus):  # the workers' compute threads must not share cores
                    proc.start()
                logger.info("data-parallel worker %d on CPUs %s", w.rank, describe(cpus))
                procs.append(proc)
            _wait_healthy(workers, procs)
            router = ctx.Process(target=_run_router, args=(router_kwargs(server_args, workers, metrics_port),),
                                 name="arborlm-router")
            router.start()
            procs.insert(0, router)
            _wait_registered(_local_url(cfg.host, cfg.port), len(workers), router, cfg.api_key)
            logger.info("%d workers behind sglang-router (%s) on http://%s:%d: ready", len(workers),
                        server_args.parallel.router_policy, cfg.host, cfg.port)
            _supervise(router, procs[1:])
        except _Stop:
            logger.info("stopping the router and %d workers", len(workers))
        finally:
            _stop_all(procs)


class _Stop(Exception):
    """Raised in the main thread by SIGINT/SIGTERM."""


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    def handler(signum, frame):
        raise _Stop()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _wait_healthy(workers: list[WorkerSpec], procs: list[BaseProcess]) -> None:
    """Block until every worker answers GET /health with 200.

    Raises
    ------
    EngineDeadError: a worker exited or did not become healthy in time.
    """
    pending = {w.rank: w for w in workers}
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    while pending:
        for rank, w in list(pending.items()):
            if not procs[rank].is_alive():
                raise EngineDeadError(f"data-parallel worker {rank} exited with status {procs[rank].exitcode} "
                                      "while starting (its log above says why)")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{w.url}/health", timeout=2).status_code == 200:
                    del pending[rank]
        if time.monotonic() > deadline:
            raise EngineDeadError(f"data-parallel workers {sorted(pending)} did not start in "
                                  f"{WORKER_START_TIMEOUT_S:.0f} s")
        if pending:
            time.sleep(POLL_INTERVAL_S)


def _local_url(host: str, port: int) -> str:
    """The router's URL from this machine (a wildcard bind address is reached on loopback)."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1" if host != "::" else "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _wait_registered(router_url: str, n: int, router: BaseProcess, api_key: str | None) -> None:
    """Block until the router lists `n` healthy workers (`GET /workers`, which takes the
    router's API key): its `/health` answers before it has registered them.

    Raises
    ------
    EngineDeadError: the router exited, or did not register the workers in time.
    """
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if not router.is_alive():
            raise EngineDeadError(f"the router exited with status {router.exitcode} while starting")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            listed = httpx.get(f"{router_url}/workers", headers=headers, timeout=2).json().get("workers", [])
            if sum(1 for w in listed if w.get("is_healthy")) >= n:
                return
        time.sleep(POLL_INTERVAL_S)
    raise EngineDeadError(f"the router did not register the {n} workers in {WORKER_START_TIMEOUT_S:.0f} s")


def _supervise(router: BaseProcess, workers: list[BaseProcess]) -> None:
    """Return when the router or every worker has exited; log each worker that dies.

    Raises
    ------
    EngineDeadError: the router or every worker died (the signal path raises `_Stop` instead).
    """
    dead: set[str] = set()
    while True:
        if not router.is_alive():
            raise EngineDeadError(f"the router exited with status {router.exitcode}")
        for proc in workers:
            if not proc.is_alive() and proc.name not in dead:
                dead.add(proc.name)
                logger.error("%s exited with status %s; the router stops sending it requests",
                             proc.name, proc.exitcode)
        if len(dead) == len(workers):
            raise EngineDeadError("every data-parallel worker has died")
        time.sleep(POLL_INTERVAL_S)


def _stop_all(procs: list[BaseProcess]) -> None:
    """SIGTERM each process (router first, so no new request reaches a stopping worker),
    then wait; kill what has not exited in `STOP_TIMEOUT_S`."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            logger.warning("%s did not stop in %.0f s; killing it", proc.name, STOP_TIMEOUT_S)
            proc.kill()
            proc.join()
