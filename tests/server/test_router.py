"""arborlm workers behind SGLang's router (`sglang-router`, issue 23).

First, what the router sends: it re-encodes every `/generate` body with SGLang's full
field set at its defaults (`model: null`, `log_metrics`, `return_hidden_states`, ...);
a worker must serve that and refuse the same fields set to a feature it lacks. Then
`arborlm serve --dp-size 2`: two tiny-model workers and the router on one port, native
and OpenAI routes through it, API keys checked end to end, and a killed worker taken
out while the other keeps serving.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from tests.server.conftest import API_KEY, start_server, stop_server, wait_idle

# The body sglang-router 0.3.2 forwards for `{"text": ..., "sampling_params": ...}`
# (captured from the router in front of an echo server).
ROUTER_FIELDS = {"model": None, "return_text_in_logprobs": False, "log_metrics": True,
                 "return_hidden_states": False, "background": False, "no_logs": False,
                 "return_bytes": False, "return_entropy": False}


def _greedy(text: str, **extra) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": 6, "temperature": 0}, **extra}


def test_generate_accepts_sglang_fields_at_their_neutral_value(http):
    plain = http.post("/generate", json=_greedy("The sky is"))
    routed = http.post("/generate", json=_greedy("The sky is", **ROUTER_FIELDS))
    assert plain.status_code == routed.status_code == 200, routed.text
    assert routed.json()["output_ids"] == plain.json()["output_ids"]
    more = {"lora_path": None, "image_data": None, "session_id": "s1", "custom_labels": {"team": "a"},
            "routed_dp_rank": None, "return_routed_experts": False, "routed_experts_start_len": 0}
    assert http.post("/generate", json=_greedy("The sky is", **more)).status_code == 200


@pytest.mark.parametrize(("field", "value"), [
    ("return_hidden_states", True), ("image_data", "http://example.com/cat.png"), ("lora_path", "adapter"),
    ("background", True), ("return_entropy", True), ("data_parallel_rank", 1), ("model", 3),
    ("temprature", 0.5),
])
def test_generate_refuses_unsupported_sglang_fields_by_name(http, field, value):
    r = http.post("/generate", json=_greedy("x", **{field: value}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert field in r.json()["error"]["message"]
    assert http.post("/generate", json=_greedy("x")).status_code == 200  # and it keeps serving


def test_server_info_names_the_loaded_model(http, server):
    for route in ("/server_info", "/get_server_info"):
        info = http.get(route).json()
        assert info["model_path"] == server.model_dir
        assert info["served_model_name"]
    assert http.get("/model_info").json() == http.get("/get_model_info").json()


# ---- --dp-size 2 behind the router ----------------------------------------------------


@pytest.fixture(scope="module")
def dp_server(tiny_llama_dir, tmp_path_factory):
    pytest.importorskip("sglang_router")
    srv = start_server(tiny_llama_dir, tmp_path_factory.mktemp("dp") / "dp.log", "--dp-size", "2", "--log-level", "info")
    _wait_router_ready(srv)
    yield srv
    stop_server(srv)


def _wait_router_ready(srv, timeout_s: float = 120.0) -> None:
    """/health of the router answers before it has registered the workers: wait for both
    (the command logs "N workers behind sglang-router ...: ready" at the same point)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "workers behind sglang-router" in srv.log():
            with srv.client() as client:
                workers = client.get("/workers").json()["workers"]
            assert sum(w["is_healthy"] for w in workers) == 2, workers
            return
        time.sleep(0.5)
    raise AssertionError(f"the router did not register the workers in time:\n{srv.log()}")


def _worker_pids(srv) -> dict[int, int]:
    """{loopback port: pid} of the data-parallel workers (children of `arborlm serve` that listen)."""
    psutil = pytest.importorskip("psutil")
    out = {}
    for child in psutil.Process(srv.process.pid).children():
        ports = {c.laddr.port for c in child.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        if ports and srv.port not in ports:  # the router is the child on the public port
            out.update(dict.fromkeys(ports, child.pid))
    return out


def test_dp_serves_native_and_openai_routes_through_the_router(dp_server, tiny_llama_dir):
    with dp_server.client() as client:
        single = client.post("/generate", json=_greedy("Once upon a time"))
        assert single.status_code == 200, single.text
        body = single.json()
        assert body["meta_info"]["completion_tokens"] == len(body["output_ids"]) == 6
        with client.stream("POST", "/generate", json={**_greedy("Once upon a time"), "stream": True}) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-1]["output_ids"] == body["output_ids"]  # greedy: the same on either worker
        chat = client.post("/v1/chat/completions", json={
            "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == 4
        # The router re-encodes Responses bodies too (stream, store, ... as null).
        resp = client.post("/v1/responses", json={"model": "default", "input": "hi", "max_output_tokens": 4})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["output_tokens"] == 4
    # The workers check the client's key, which the router passes on.
    assert httpx.post(f"{dp_server.base_url}/generate", json=_greedy("x")).status_code == 401


def _worker_info(port: int) -> dict:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=30) as worker:
        return wait_idle(worker)


def test_dp_cache_aware_keeps_a_prefix_on_one_worker_and_slots_return(dp_server):
    ports = sorted(_worker_pids(dp_server))
    assert len(ports) == 2, dp_server.log()
    before = {p: _worker_info(p)["cached_kv_tokens"] for p in ports}
    system = "You are a careful assistant for the shipping team. " * 6
    with dp_server.client() as client:
        for i in range(4):
            assert client.post("/generate", json=_greedy(f"{system}Question {i}:")).status_code == 200
    after = {p: _worker_info(p) for p in ports}
    grew = [p for p in ports if after[p]["cached_kv_tokens"] > before[p]]
    assert len(grew) == 1, (before, after)  # every request with the shared prefix went to one worker
    for info in after.values():
        assert info["free_req_rows"] == info["total_req_rows"]
        assert info["free_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]


def test_dp_a_client_disconnect_at_the_router_aborts_on_the_worker(dp_server):
    # 900 tokens take the tiny model about a second; the client hangs up after the first event,
    # the router drops its upstream connection and the worker aborts the request.
    ports = sorted(_worker_pids(dp_server))
    before = {p: _worker_info(p)["num_generated_tokens"] for p in ports}
    body = {"text": "a long story", "stream": True, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    with dp_server.client() as client, client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if line.startswith("data: {"))
    after = {p: _worker_info(p) for p in ports}
    generated = sum(after[p]["num_generated_tokens"] - before[p] for p in ports)
    assert 0 < generated < 900, (before, after)  # stopped before its max_new_tokens
    for info in after.values():
        assert info["num_running_reqs"] == 0 and info["free_req_rows"] == info["total_req_rows"]
        assert info["free_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]


def test_dp_bad_requests_do_not_take_the_workers_out(dp_server):
    # A worker's 400 is the client's own error: the router must keep routing to that worker.
    with dp_server.client() as client:
        for _ in range(6):
            bad = client.post("/v1/chat/completions", json={
                "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6})
            assert bad.status_code == 400, bad.text
            refused = client.post("/generate", json={**_greedy("x"), "return_hidden_states": True})
            assert refused.status_code == 400 and "return_hidden_states" in refused.text
        for i in range(4):
            good = client.post("/generate", json=_greedy(f"right after the bad ones {i}"))
            assert good.status_code == 200, good.text
        workers = client.get("/workers").json()["workers"]
    assert sum(w["is_healthy"] for w in workers) == 2, workers


def test_dp_workers_run_on_disjoint_cores(dp_server):
    # Two workers whose kernels both spread over every core wait on each other's threads.
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("this machine lets the test use one CPU: both workers share it with one thread each, "
                    "so there are no two slices to keep apart (nothing is lost)")
    masks = [os.sched_getaffinity(pid) for pid in _worker_pids(dp_server).values()]
    assert len(masks) == 2 and not masks[0] & masks[1] and masks[0] | masks[1] == set(cpus)


def test_dp_a_killed_worker_is_taken_out_and_the_other_serves(dp_server):
    import signal

    pids = _worker_pids(dp_server)
    assert len(pids) == 2
    victim = min(pids)
    os.kill(pids[victim], signal.SIGKILL)
    ok, failed = 0, []
    with dp_server.client() as client:
        # The router's health checks (every second) drop the dead worker within a few seconds;
        # a request it sends there until then fails with a 5xx, never a hang.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if sum(w["is_healthy"] for w in client.get("/workers").json()["workers"]) == 1:
                break
            r = client.post("/generate", json=_greedy("during the crash"))
            if r.status_code != 200:
                failed.append(r.status_code)
            time.sleep(0.2)
        for i in range(6):
            r = client.post("/generate", json=_greedy(f"after the crash {i}"))
            ok += r.status_code == 200
    assert all(500 <= code < 600 for code in failed), failed
    assert ok == 6, dp_server.log()[-3000:]
    assert dp_server.process.poll() is None  # the command keeps running with one worker
