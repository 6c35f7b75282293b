"""Watchdog: the scheduler's loop hangs mid-run (a step that never returns, through the
test-only `ARBORLM_TEST_HANG_AFTER_STEPS`; only the loop thread stops, unlike SIGSTOP)
on a server with `--watchdog-timeout 2`. `/get_server_info` answers a 503 in bounded time
instead of waiting; the watchdog logs the hang with every thread's stack and ends the
scheduler; in-flight requests get 503 `engine_dead` (a stream an error event); the
server exits by itself and frees its port."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.reliability.bad_requests import check_error_body
from tests.reliability.conftest import launch, wait_healthy
from tests.server.conftest import API_KEY, stop_server

WATCHDOG_TIMEOUT_S = 2
# The front's reply timeout is min(watchdog_timeout, 10 s); the rest is a busy machine's delay.
INFO_ANSWER_LIMIT_S = WATCHDOG_TIMEOUT_S + 4
# Enough steps to prefill both requests and decode a few tokens before the hang.
HANG_AFTER_STEPS = 8
EXIT_TIMEOUT_S = 30
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def hanging_server(tiny_llama_dir, tmp_path_factory):
    """A server whose scheduler loop hangs in its step after `HANG_AFTER_STEPS`."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ARBORLM_TEST_HANG_AFTER_STEPS", str(HANG_AFTER_STEPS))  # read by the scheduler process
        srv = launch(tiny_llama_dir, tmp_path_factory.mktemp("watchdog") / "server.log",
                     ("--max-total-tokens", "4096", "--max-running-requests", "8",
                      "--watchdog-timeout", str(WATCHDOG_TIMEOUT_S)))
    yield wait_healthy(srv)
    stop_server(srv)


def _start_requests(base_url: str) -> tuple[dict[str, object], list[threading.Thread]]:
    """A stream and a plain request, each long enough to be in flight when the loop hangs."""
    got: dict[str, object] = {}

    def stream() -> None:
        body = {"prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=HEADERS,
                          timeout=EXIT_TIMEOUT_S) as response:
            got["stream_status"] = response.status_code
            got["stream_body"] = [line for line in response.iter_lines() if line.strip()]

    def plain() -> None:
        body = {"text": "y", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
        got["plain"] = httpx.post(f"{base_url}/generate", json=body, headers=HEADERS, timeout=EXIT_TIMEOUT_S)

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for thread in threads:
        thread.start()
    return got, threads


def _first_info_refusal(base_url: str) -> httpx.Response | None:
    """Poll /get_server_info until it stops answering 200; each call must end in bounded time.

    Returns the first non-200 answer, or None when the server went away first."""
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            response = httpx.get(f"{base_url}/get_server_info", headers=HEADERS, timeout=EXIT_TIMEOUT_S)
        except (httpx.ConnectError, httpx.RemoteProtocolError):
            return None  # the server is already stopping
        took_s = time.monotonic() - started
        assert took_s < INFO_ANSWER_LIMIT_S, f"/get_server_info took {took_s:.1f} s"
        if response.status_code != 200:
            return response
        time.sleep(0.05)
    pytest.fail("/get_server_info kept answering 200: the loop never hung")


def _assert_stream_failed(got: dict[str, object]) -> None:
    """The stream ended with an error: a 503 before its first event, or an error event and [DONE]."""
    lines = got["stream_body"]
    if got["stream_status"] == 503:
        assert check_error_body(json.loads(lines[0]))["code"] == "engine_dead"
        return
    assert got["stream_status"] == 200
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == "engine_dead", error


def test_a_hung_scheduler_is_ended_by_its_watchdog(hanging_server, tally):
    srv = hanging_server
    got, threads = _start_requests(srv.base_url)

    refusal = _first_info_refusal(srv.base_url)
    if refusal is not None:
        assert refusal.status_code == 503, refusal.text
        # scheduler_timeout: the reply timeout ran out first; engine_dead: the watchdog was quicker
        assert check_error_body(refusal.json())["code"] in ("scheduler_timeout", "engine_dead")

    code = srv.process.wait(EXIT_TIMEOUT_S)
    for thread in threads:
        thread.join(EXIT_TIMEOUT_S)
        assert not thread.is_alive(), "an in-flight request hung"
    assert code == 1, code  # `arborlm serve: error: the scheduler process exited (code 124): ...`
    log = srv.log()
    assert f"watchdog_timeout={WATCHDOG_TIMEOUT_S} s" in log, log
    assert "in _hang_forever" in log, log  # faulthandler's stack of the stuck loop thread
    assert "scheduler process exited (code 124): its watchdog" in log, log
    plain = got["plain"]
    assert plain.status_code == 503, plain.text
    assert check_error_body(plain.json())["code"] == "engine_dead"
    _assert_stream_failed(got)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.base_url}/health", timeout=2)
    tally["watchdog"][0] += 3
    tally["watchdog"][1] += 3
