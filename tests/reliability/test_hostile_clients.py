"""Hostile and careless clients against a running server: keys a header cannot carry, bodies
a browser sends cross-origin (CSRF), DNS rebinding, key holders reaching for admin routes,
keys visible in `ps`, and the prefix cache as an oracle on other clients' prompts.

The module's server takes its API key from `--api-key-file` and its admin key from
`ARBORLM_ADMIN_API_KEY` (neither on the command line), accepts the extra Host name
`arbor.test`, and leaves the cache report off (the default). Each check counts into the
battery's tally ("hostile clients")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest

from tests.reliability.bad_requests import check_error_body
from tests.reliability.conftest import wait_healthy
from tests.server.conftest import ServerProcess, free_port, stop_server

USER_KEY = "hostile-user-key"
ADMIN_KEY = "hostile-admin-key"
EXTRA_HOST = "arbor.test"
# A prompt long enough that a second send finds most of it in the radix cache.
SHARED_PROMPT = "The secret plan of the other client is written here in full: " * 8
TALLY = "hostile clients"


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    key_file = folder / "api_key"
    key_file.write_text(USER_KEY + "\n")
    port = free_port()
    cmd = [sys.executable, "-m", "arborlm", "serve", "--model", str(tiny_llama_dir), "--port", str(port),
           "--dtype", "float32", "--random-seed", "1234", "--log-level", "warning", "--max-total-tokens", "4096",
           "--max-running-requests", "8", "--api-key-file", str(key_file), "--allowed-hosts", EXTRA_HOST]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ARBORLM_ADMIN_API_KEY": ADMIN_KEY}
    env.pop("ARBORLM_API_KEY", None)
    log_path = folder / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    srv = ServerProcess(process, f"http://127.0.0.1:{port}", port, log_path, str(tiny_llama_dir))
    try:
        yield wait_healthy(srv)
    finally:
        stop_server(srv)


def client(server: ServerProcess, key: str | bytes | None = USER_KEY, **headers) -> httpx.Client:
    if key is not None:
        headers["Authorization"] = b"Bearer " + (key if isinstance(key, bytes) else key.encode())
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=60)


@pytest.fixture
def count(tally):
    """Count one case of the battery; passed only if the test body returns normally."""
    entry = tally[TALLY]
    entry[0] += 1
    yield
    entry[1] += 1


def test_keys_are_not_on_the_command_line(server, count):
    with open(f"/proc/{server.process.pid}/cmdline", "rb") as f:
        cmdline = f.read()
    assert USER_KEY.encode() not in cmdline and ADMIN_KEY.encode() not in cmdline
    with client(server) as http:
        info = http.get("/get_server_info").json()
    assert info["api_key"] == info["admin_api_key"] == "<redacted>"


@pytest.mark.parametrize("token", ["ключ".encode(), "caf\u00e9".encode("latin-1"), b"\xff" * 64,
                                   ("Bearer " + USER_KEY + "\u00e9").encode()])
def test_non_ascii_bearer_token_is_401(server, count, token):
    with client(server, key=token) as http:
        response = http.get("/v1/models")
        assert response.status_code == 401, response.text
        assert check_error_body(response.json())["code"] == "invalid_api_key"
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    ("/abort_request", {"rid": "nobody"}),
])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_json_sent_as_a_form_is_415(server, count, path, body, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    with client(server) as http:
        response = http.post(path, content=json.dumps(body).encode(), headers=headers)
        assert response.status_code == 415, response.text
        assert check_error_body(response.json())["code"] == "unsupported_media_type"
        with_charset = http.post(path, content=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json; charset=utf-8"})
        assert with_charset.status_code == 200, with_charset.text


@pytest.mark.parametrize("host, status", [
    ("evil.example", 400), ("evil.example:{port}", 400), ("127.0.0.1.evil.example", 400),
    ("localhost:{port}", 200), ("127.0.0.1:{port}", 200), (EXTRA_HOST + ":{port}", 200),
])
def test_dns_rebinding_is_refused(server, count, host, status):
    with client(server, Host=host.format(port=server.port)) as http:
        response = http.get("/v1/models")
    assert response.status_code == status, response.text
    if status == 400:
        assert check_error_body(response.json())["code"] == "invalid_host"


def test_cross_site_flush_is_refused(server, count):
    with client(server, key=ADMIN_KEY, **{"Sec-Fetch-Site": "cross-site"}) as http:
        response = http.get("/flush_cache")
    assert response.status_code == 403 and check_error_body(response.json())["code"] == "cross_site_request"


def test_admin_routes_need_the_admin_key(server, count):
    with client(server) as user, client(server, key=ADMIN_KEY) as admin:
        for method in ("GET", "POST"):
            refused = user.request(method, "/flush_cache")
            assert refused.status_code == 403, refused.text
            assert check_error_body(refused.json())["code"] == "insufficient_permissions"
        assert user.post("/abort_request", json={"abort_all": True}).status_code == 403
        assert user.post("/abort_request", json={"rid": "nobody"}).status_code == 200  # one by id: a user route
        assert admin.post("/flush_cache").status_code == 200
        assert admin.post("/abort_request", json={"abort_all": True}).status_code == 200
        assert admin.get("/v1/models").status_code == 200  # the admin key opens the user routes too
    with client(server, key=None) as anonymous:
        assert anonymous.post("/flush_cache").status_code == 401


def test_every_answer_has_a_request_id(server, count):
    with client(server) as http, client(server, key="wrong") as wrong:
        answers = [http.get("/v1/models"), http.get("/nowhere"), wrong.get("/v1/models"), http.get("/health"),
                   http.post("/generate", content=b"{}", headers={"Content-Type": "text/plain"})]
    ids = [a.headers.get("x-request-id") for a in answers]
    assert all(i and i.startswith("req_") for i in ids) and len(set(ids)) == len(ids), ids


def test_the_openai_client_works_with_the_key_from_the_file(server, count):
    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=USER_KEY, max_retries=0, timeout=60)
    out = oai.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.usage.completion_tokens >= 1


def test_cached_tokens_are_not_reported_by_default(server, count):
    """Without --enable-cache-report, a second client sending the first one's prompt cannot tell
    from the answer that it was cached (SGLang leaves prompt_tokens_details out)."""
    chat = {"messages": [{"role": "user", "content": SHARED_PROMPT}], "max_tokens": 1}
    with client(server) as victim, client(server) as prober:
        assert victim.post("/v1/chat/completions", json=chat).status_code == 200
        probe = prober.post("/v1/chat/completions", json=chat).json()["usage"]
        assert "prompt_tokens_details" not in probe
        with prober.stream("POST", "/v1/chat/completions",
                           json={**chat, "stream": True, "stream_options": {"include_usage": True}}) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
        assert "prompt_tokens_details" not in json.loads(events[-1])["usage"]
        completion = {"prompt": SHARED_PROMPT, "max_tokens": 1}
        victim.post("/v1/completions", json=completion)
        assert "prompt_tokens_details" not in prober.post("/v1/completions", json=completion).json()["usage"]
        native = {"text": SHARED_PROMPT, "sampling_params": {"max_new_tokens": 1}}
        victim.post("/generate", json=native)
        assert prober.post("/generate", json=native).json()["meta_info"]["cached_tokens"] == 0
        with prober.stream("POST", "/generate", json={**native, "stream": True}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        assert all(e["meta_info"]["cached_tokens"] == 0 for e in events)
        # the cache did serve the prompt: the server's own counters still see it
        assert prober.get("/get_server_info").json()["cache_hit_rate"] > 0
