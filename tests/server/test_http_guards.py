"""The HTTP server's guards against hostile and careless clients, on the app alone (no model,
no scheduler: a route that gets past every guard answers 503 "starting"): bearer keys and the
admin key, Host and cross-site checks, the JSON content type, request ids and 500 bodies.
The same behaviours against a running server: tests/reliability/test_hostile_clients.py."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from arborlm.entrypoints.auth import KeyPolicy, Role, bearer_token
from arborlm.entrypoints.browser_guard import HostPolicy, host_name, is_json_media_type
from arborlm.entrypoints.http_server import create_app
from arborlm.entrypoints.server_state import ServerState
from arborlm.entrypoints.streaming import sse, sse_response
from arborlm.runtime.config import ServerArgs

USER, ADMIN = "user-key", "admin-key"
SECRET_TEXT = "/opt/arborlm/secret_module.py: CUDA error: device-side assert"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def make_app(**server_args):
    app = create_app(ServerState(server_args=ServerArgs.from_kwargs(**server_args), model_info=None,
                                 tokenizer=None, scheduler=None, metrics=None))

    async def crash():
        raise RuntimeError(SECRET_TEXT)

    async def crash_mid_stream():
        async def events():
            yield sse({"text": "a"})
            raise RuntimeError(SECRET_TEXT)

        return sse_response(events())

    app.add_api_route("/crash", crash, methods=["GET"])
    app.add_api_route("/crash_stream", crash_mid_stream, methods=["GET"])
    return app


def call(app, method: str, path: str, headers: dict | None = None, **kwargs) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:30000") as client:
            return await client.request(method, path, headers=headers, **kwargs)

    return asyncio.run(go())


def bearer(key: str | bytes) -> dict:
    return {"Authorization": b"Bearer " + (key if isinstance(key, bytes) else key.encode())}


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# ---- bearer keys --------------------------------------------------------------------------------


@pytest.mark.parametrize("token", ["ключ".encode(), "café".encode("latin-1"), b"\xff\xfe", "Bearer ключ".encode()])
def test_a_non_ascii_bearer_token_is_401_not_500(token):
    response = call(make_app(api_key=USER), "GET", "/v1/models", headers=bearer(token))
    assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"


@pytest.mark.parametrize("authorization, token", [
    (None, None), (b"", None), (b"Bearer", None), (b"Bearer ", None), (b"Basic abc", None),
    (b"Bearer abc", b"abc"), (b"bearer   abc  ", b"abc"), (b"BEARER a b", b"a b"),
])
def test_bearer_token(authorization, token):
    assert bearer_token(authorization) == token


# api_key, admin_api_key, the key sent → role
ROLE_TABLE = [
    (None, None, None, Role.ADMIN), (None, None, "x", Role.ADMIN),
    (USER, None, None, Role.NONE), (USER, None, "x", Role.NONE), (USER, None, USER, Role.ADMIN),
    (None, ADMIN, None, Role.OPEN), (None, ADMIN, "x", Role.OPEN), (None, ADMIN, ADMIN, Role.ADMIN),
    (USER, ADMIN, None, Role.NONE), (USER, ADMIN, USER, Role.USER), (USER, ADMIN, ADMIN, Role.ADMIN),
]


@pytest.mark.parametrize("api_key, admin_api_key, sent, role", ROLE_TABLE)
def test_roles(api_key, admin_api_key, sent, role):
    header = None if sent is None else f"Bearer {sent}".encode()
    assert KeyPolicy(api_key, admin_api_key).role_of(header) is role


# api_key, admin_api_key, the key sent → status of a user route, of flush_cache (503: let through)
ACCESS_TABLE = [
    (None, None, None, 503, 503),
    (USER, None, None, 401, 401), (USER, None, USER, 503, 503),  # SGLang: api_key holders may flush
    (None, ADMIN, None, 503, 401), (None, ADMIN, ADMIN, 503, 503),
    (USER, ADMIN, USER, 503, 403), (USER, ADMIN, ADMIN, 503, 503), (USER, ADMIN, "x", 401, 401),
]


@pytest.mark.parametrize("api_key, admin_api_key, sent, user_status, admin_status", ACCESS_TABLE)
def test_admin_routes_need_the_admin_key_when_one_is_set(api_key, admin_api_key, sent, user_status, admin_status):
    app = make_app(api_key=api_key, admin_api_key=admin_api_key)
    headers = bearer(sent) if sent else None
    assert call(app, "GET", "/get_server_info", headers).status_code == user_status
    for method in ("GET", "POST"):
        response = call(app, method, "/flush_cache", headers)
        assert response.status_code == admin_status, response.text
    abort_all = call(app, "POST", "/abort_request", headers, json={"abort_all": True})
    assert abort_all.status_code == admin_status
    by_rid = call(app, "POST", "/abort_request", headers, json={"rid": "r"})
    assert by_rid.status_code == user_status  # aborting one request by id is a user route
    if admin_status == 403:
        assert error_of(call(app, "GET", "/flush_cache", headers))["code"] == "insufficient_permissions"


def test_health_and_metrics_stay_open():
    app = make_app(api_key=USER, admin_api_key=ADMIN)
    assert call(app, "GET", "/health").status_code == 503  # past the key check; the app is not started
    assert call(app, "GET", "/v1/models").status_code == 401


# ---- Host and cross-site requests ------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:30000", "localhost", "LOCALHOST:80", "[::1]",
                                  "[::1]:30000", "127.0.0.2:1"])
def test_loopback_names_are_answered(host):
    assert call(make_app(), "GET", "/v1/models", {"Host": host}).status_code != 400


@pytest.mark.parametrize("host", ["evil.example", "evil.example:30000", "127.0.0.1.evil.example", "localhost.evil",
                                  "0.0.0.0:30000", "[::2]", "", "10.0.0.5"])
def test_dns_rebinding_is_refused_on_a_loopback_bind(host):
    response = call(make_app(), "GET", "/v1/models", {"Host": host})
    assert response.status_code == 400 and error_of(response)["code"] == "invalid_host"


@pytest.mark.parametrize("allowed, host, ok", [
    (["box.lan"], "box.lan:30000", True), (["box.lan"], "other.lan", False),
    (["*.example.com"], "api.example.com", True), (["*.example.com"], "example.com", False),
    (["*.example.com"], "evilexample.com", False), (["[fd00::1]"], "[fd00::1]:8", True),
    (["*"], "anything.at.all", True),
])
def test_allowed_hosts_widen_the_list(allowed, host, ok):
    response = call(make_app(allowed_hosts=allowed), "GET", "/v1/models", {"Host": host})
    assert (response.status_code != 400) is ok
    assert call(make_app(allowed_hosts=allowed), "GET", "/v1/models", {"Host": "localhost"}).status_code != 400


def test_a_public_bind_answers_any_host_unless_allowed_hosts_is_given():
    assert call(make_app(host="0.0.0.0"), "GET", "/v1/models", {"Host": "box.lan"}).status_code != 400
    refused = call(make_app(host="0.0.0.0", allowed_hosts=["api.lan"]), "GET", "/v1/models", {"Host": "box.lan"})
    assert refused.status_code == 400


@pytest.mark.parametrize("header, name", [("Box.Lan:80", "box.lan"), ("[::1]:9", "[::1]"), ("[::1", ""),
                                          ("a", "a"), ("", "")])
def test_host_name(header, name):
    assert host_name(header) == name


def test_host_policy_without_a_header():
    assert not HostPolicy(None, binds_loopback=True).allows(None)
    assert HostPolicy(None, binds_loopback=False).allows(None)


def test_cross_site_browser_requests_are_refused():
    app = make_app()
    for method, path in (("GET", "/flush_cache"), ("POST", "/flush_cache"), ("GET", "/v1/models")):
        response = call(app, method, path, {"Sec-Fetch-Site": "cross-site"})
        assert response.status_code == 403 and error_of(response)["code"] == "cross_site_request"
    for site in ("same-origin", "same-site", "none"):
        assert call(app, "GET", "/flush_cache", {"Sec-Fetch-Site": site}).status_code == 503
    assert call(app, "GET", "/health", {"Sec-Fetch-Site": "cross-site"}).status_code == 503  # open path


# ---- JSON content type ---------------------------------------------------------------------


JSON_ROUTES = [("/generate", {"text": "x"}), ("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", CHAT),
               ("/abort_request", {"rid": "r"})]


@pytest.mark.parametrize("path, body", JSON_ROUTES)
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None, "application/jsonp", "text/json"])
def test_json_routes_refuse_other_content_types(path, body, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    response = call(make_app(), "POST", path, headers, content=json.dumps(body).encode())
    assert response.status_code == 415, response.text
    error = error_of(response)
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]


@pytest.mark.parametrize("path, body", JSON_ROUTES)
@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8", "application/vnd.api+json"])
def test_json_routes_accept_json_with_parameters(path, body, content_type):
    response = call(make_app(), "POST", path, {"Content-Type": content_type}, content=json.dumps(body).encode())
    assert response.status_code == 503, response.text  # past the body checks


def test_the_clients_we_know_send_json():
    """The openai package and httpx's `json=` (arborlm's RuntimeEndpoint, bench_serving)
    declare application/json."""
    import openai

    sent = []

    def record(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers.get("content-type"))
        return httpx.Response(200, json={"id": "x", "object": "chat.completion", "choices": []})

    httpx.Client(transport=httpx.MockTransport(record)).post("http://h/generate", json={"text": "x"})
    client = openai.OpenAI(base_url="http://h/v1", api_key="k", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(record)))
    client.chat.completions.create(model="m", messages=CHAT["messages"])
    client.completions.create(model="m", prompt="x")
    assert len(sent) == 3 and all(is_json_media_type(c) for c in sent), sent


def test_requests_json_sends_json():
    """SGLang's RuntimeEndpoint posts with requests' `json=`."""
    requests = pytest.importorskip("requests")
    prepared = requests.Request("POST", "http://h/generate", json={"text": "x"}).prepare()
    assert is_json_media_type(prepared.headers["Content-Type"])


# ---- request ids and 500 bodies -----------------------------------------------------------------


def test_every_answer_has_a_request_id():
    app = make_app(api_key=USER)
    ids = {call(app, "GET", path).headers.get("x-request-id") for path in ("/v1/models", "/health", "/nowhere")}
    assert len(ids) == 3 and all(i and i.startswith("req_") for i in ids)


def test_a_500_names_a_request_id_and_hides_the_exception(caplog):
    with caplog.at_level(logging.ERROR, logger="arborlm.entrypoints.http_errors"):
        response = call(make_app(), "GET", "/crash")
    assert response.status_code == 500
    error = error_of(response)
    request_id = response.headers["x-request-id"]
    assert request_id in error["message"] and error["code"] == "internal_error"
    assert "secret_module" not in response.text and "RuntimeError" not in response.text
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and SECRET_TEXT in str(logged[0].exc_info[1])


def test_an_error_event_mid_stream_hides_the_exception(caplog):
    with caplog.at_level(logging.ERROR, logger="arborlm.entrypoints.http_errors"):
        response = call(make_app(), "GET", "/crash_stream")
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "secret_module" not in response.text and error["code"] == "internal_error"
    error_id = error["message"].split("request id ")[1].split(";")[0]
    assert any(error_id in r.getMessage() for r in caplog.records)


# ---- the cache report ------------------------------------------------------------------------


def test_usage_reports_cached_tokens_only_when_asked():
    from arborlm.entrypoints.openai.common import UsageCounter

    meta = {"prompt_tokens": 40, "completion_tokens": 2, "cached_tokens": 39}
    hidden, shown = UsageCounter(), UsageCounter(report_cached=True)
    for usage in (hidden, shown):
        usage.add(meta, first_of_prompt=True)
    assert "prompt_tokens_details" not in hidden.to_dict() and hidden.to_dict()["prompt_tokens"] == 40
    assert shown.to_dict()["prompt_tokens_details"] == {"cached_tokens": 39}
