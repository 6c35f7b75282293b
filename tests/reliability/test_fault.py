"""Fault: the scheduler process killed (SIGKILL) mid-run. In-flight requests get an error
(503, or an error event in a stream) instead of hanging; new requests get 503 until the
server stops; the server then exits by itself with a message, leaving no process behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.reliability.bad_requests import check_error_body
from tests.reliability.conftest import process_tree
from tests.server.conftest import API_KEY

EXIT_TIMEOUT_S = 30


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return False


def test_killed_scheduler_fails_requests_and_stops_the_server(fault_server, tally):
    srv = fault_server
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tree = process_tree(srv.process.pid)
    # the scheduler is the child multiprocessing spawned (its resource tracker is another child)
    schedulers = [pid for pid in tree[1:] if b"spawn_main" in _cmdline(pid)]
    assert len(schedulers) == 1, [(pid, _cmdline(pid)) for pid in tree]
    got: dict[str, object] = {}

    def stream() -> None:
        body = {"prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, headers=headers,
                          timeout=EXIT_TIMEOUT_S) as response:
            got["stream_status"] = response.status_code
            got["events"] = [line for line in response.iter_lines() if line.startswith("data: ")]

    def plain() -> None:
        body = {"text": "y", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
        response = httpx.post(f"{srv.base_url}/generate", json=body, headers=headers, timeout=EXIT_TIMEOUT_S)
        got["plain"] = response

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{srv.base_url}/get_server_info", headers=headers).json()["num_running_reqs"] < 2:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.05)
    os.kill(schedulers[0], signal.SIGKILL)

    cases = 0
    # New requests until the server stops: each a typed 503, never a hang, never a 200 or a 500.
    while srv.process.poll() is None:
        try:
            response = httpx.post(f"{srv.base_url}/v1/chat/completions", headers=headers, timeout=10,
                                  json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        except httpx.ConnectError:
            break  # the listener is closed: the server is stopping
        except httpx.RemoteProtocolError:
            break  # the connection closed as the server went down
        if response.status_code == 200:
            continue  # sent before the scheduler died: answered before it did
        cases += 1
        assert response.status_code == 503, response.text
        assert check_error_body(response.json())["type"] == "server_error"
        time.sleep(0.05)
    code = srv.process.wait(EXIT_TIMEOUT_S)
    for thread in threads:
        thread.join(EXIT_TIMEOUT_S)
        assert not thread.is_alive(), "an in-flight request hung"
    assert code == 1, code  # `arborlm serve: error: the scheduler process exited ...`
    assert "scheduler process exited" in srv.log()
    plain_response = got["plain"]
    assert plain_response.status_code == 503, plain_response.text
    assert check_error_body(plain_response.json())["code"] == "engine_dead"
    assert got["stream_status"] == 200
    events = got["events"]
    assert events[-1] == "data: [DONE]"
    assert "error" in json.loads(events[-2][len("data: "):])
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in tree if _alive(pid)], "processes left behind"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.base_url}/health", timeout=2)
    tally["fault"][0] += 2 + cases
    tally["fault"][1] += 2 + cases
