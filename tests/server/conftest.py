"""One `arborlm serve` process on the tiny random Llama, on a free port, shared by the test modules here."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key"
STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """A running server: its process, base URL and log file."""

    process: subprocess.Popen
    base_url: str
    port: int
    log_path: Path
    model_dir: str

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=60, **kwargs)


def start_server(model_dir: Path, log_path: Path, *extra: str) -> ServerProcess:
    """Start `python -m arborlm serve` and wait until GET /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "arborlm", "serve", "--model", str(model_dir), "--port", str(port),
           "--dtype", "float32", "--max-total-tokens", "8192", "--random-seed", "1234",
           "--log-level", "warning", "--api-key", API_KEY, *extra]
    log = open(log_path, "w")  # noqa: SIM115 - the child writes it for its whole life
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = ServerProcess(process, f"http://127.0.0.1:{port}", port, log_path, str(model_dir))
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server did not become healthy:\n{server.log()}")


def wait_idle(client: httpx.Client, timeout_s: float = 10.0) -> dict:
    """Wait until no request runs or waits; returns the last /get_server_info."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.get("/get_server_info").json()
        idle = info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["num_in_flight_reqs"] == 0
        if idle or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def stop_server(srv: ServerProcess) -> None:
    if srv.process.poll() is None:
        srv.process.terminate()
        try:
            srv.process.wait(30)
        except subprocess.TimeoutExpired:
            srv.process.kill()


@pytest.fixture(scope="session")
def _servers():
    """Every server started this session; stopped at its end."""
    started: list[ServerProcess] = []
    yield started
    for srv in started:
        stop_server(srv)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory, _servers):
    """The tiny model's server, shared by the modules of this folder: started on first use,
    and again only after a module has stopped it (test_server.py ends with SIGTERM)."""
    if _servers and _servers[-1].process.poll() is None:
        return _servers[-1]
    # --enable-cache-report: test_server.py checks the cached-token counts (off by default)
    srv = start_server(tiny_llama_dir, tmp_path_factory.mktemp("server") / "server.log",
                       "--max-running-requests", "16", "--max-queued-requests", "32", "--enable-cache-report")
    _servers.append(srv)
    return srv


@pytest.fixture
def http(server):
    """An authorised httpx client; afterwards every KV slot and request row must be back in its pool."""
    with server.client() as client:
        yield client
        if server.process.poll() is not None:
            return
        info = wait_idle(client)
        assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
        assert info["free_req_rows"] == info["total_req_rows"]
        assert info["free_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]
