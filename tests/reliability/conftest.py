"""Servers for the reliability battery: `arborlm serve` on the tiny random Llama, one per setting.

- `main_server`: a roomy KV pool, 32 running + 256 queued requests, a 2 MiB body limit and a
  10 s grammar compile timeout (bad input, abort storm, soak; the unpressured reference).
- `pressured_server`: a 400-token KV pool, too small for its running batch (KV pressure).
- `fault_server`: a server whose scheduler the fault test kills.

Every server the collected tests need is launched at once when the first is asked for, so
their start-up (model load, ~20 s on a busy machine) overlaps. The terminal summary ends
with the battery's counts: per check, cases tried and passed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import API_KEY, ServerProcess, free_port, stop_server, wait_idle

STARTUP_TIMEOUT_S = 240
MAX_REQUEST_BYTES = 2 * 1024 * 1024
MAIN_QUEUE = 256
MAIN_RUNNING = 64
PRESSURED_POOL_TOKENS = 400

SERVER_FLAGS = {
    "main_server": ("--max-total-tokens", "8192", "--max-running-requests", str(MAIN_RUNNING),
                    "--max-queued-requests", str(MAIN_QUEUE), "--max-request-bytes", str(MAX_REQUEST_BYTES),
                    "--grammar-compile-timeout", "10"),
    # admit eagerly (5% of max_new_tokens reserved) so that decoding runs out of slots and must retract
    "pressured_server": ("--max-total-tokens", str(PRESSURED_POOL_TOKENS), "--max-running-requests", "16",
                         "--max-queued-requests", "64", "--init-new-token-ratio", "0.05",
                         "--min-new-token-ratio", "0.0", "--chunked-prefill-size", "64"),
    "fault_server": ("--max-total-tokens", "4096", "--max-running-requests", "8"),
}

_TALLY = pytest.StashKey[dict]()


def launch(model_dir: Path, log_path: Path, flags: tuple[str, ...]) -> ServerProcess:
    """Start `python -m arborlm serve` without waiting for it."""
    port = free_port()
    cmd = [sys.executable, "-m", "arborlm", "serve", "--model", str(model_dir), "--port", str(port),
           "--dtype", "float32", "--random-seed", "1234", "--log-level", "warning", "--api-key", API_KEY, *flags]
    log = open(log_path, "w")  # noqa: SIM115 - the child writes it for its whole life
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return ServerProcess(process, f"http://127.0.0.1:{port}", port, log_path, str(model_dir))


def wait_healthy(server: ServerProcess) -> ServerProcess:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited with {server.process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.process.kill()
    raise RuntimeError(f"the server did not become healthy:\n{server.log()}")


@pytest.fixture(scope="session")
def _launched(request, tiny_llama_dir, tmp_path_factory):
    """Launch the servers every collected battery test needs, all at once; stop them at the end."""
    needed = {name for item in request.session.items for name in getattr(item, "fixturenames", ())
              if name in SERVER_FLAGS}
    folder = tmp_path_factory.mktemp("reliability")
    servers = {name: launch(tiny_llama_dir, folder / f"{name}.log", SERVER_FLAGS[name]) for name in sorted(needed)}
    yield servers
    for srv in servers.values():
        stop_server(srv)


def _server(launched: dict[str, ServerProcess], name: str) -> ServerProcess:
    return wait_healthy(launched[name])


@pytest.fixture(scope="session")
def main_server(_launched):
    return _server(_launched, "main_server")


@pytest.fixture(scope="session")
def pressured_server(_launched):
    return _server(_launched, "pressured_server")


@pytest.fixture(scope="session")
def fault_server(_launched):
    return _server(_launched, "fault_server")


def assert_pools_whole(client: httpx.Client, flush: bool = True) -> dict:
    """Wait for idle; optionally flush the radix cache; then every KV slot and request row is free.

    Returns the last `/get_server_info`.
    """
    info = wait_idle(client, timeout_s=60)
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["num_in_flight_reqs"] == 0, info
    assert info["free_req_rows"] == info["total_req_rows"]
    if not flush:
        assert info["free_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]
        return info
    response = client.post("/flush_cache")
    assert response.status_code == 200, response.text
    info = client.get("/get_server_info").json()
    assert info["free_kv_tokens"] == info["max_total_tokens"] and info["cached_kv_tokens"] == 0, info
    return info


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (from /proc/<pid>/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo += [int(p) for p in f.read().split()]
        except FileNotFoundError:
            continue
    return found


def rss_bytes(pids: list[int]) -> int:
    """Summed resident memory (VmRSS) of the live processes among `pids`."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except FileNotFoundError:
            continue
    return total


@pytest.fixture(scope="session")
def tally(request) -> dict[str, list[int]]:
    """check name → [cases tried, cases passed]; printed at the end of the session."""
    return request.config.stash.setdefault(_TALLY, defaultdict(lambda: [0, 0]))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts = config.stash.get(_TALLY, None)
    if not counts:
        return
    terminalreporter.section("reliability battery")
    for name, (tried, passed) in counts.items():
        terminalreporter.write_line(f"{name}: {passed}/{tried} cases passed")
    tried = sum(c[0] for c in counts.values())
    passed = sum(c[1] for c in counts.values())
    terminalreporter.write_line(f"total: {passed}/{tried} cases passed")
