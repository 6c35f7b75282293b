"""The same programs on the Engine, on `RuntimeEndpoint` and on the `OpenAI` backend against one
`arborlm serve` on the tiny model (one server for this module): same greedy results, clear refusals."""

from __future__ import annotations

import httpx
import pytest

import arborlm as sgl
from arborlm.frontend_lang.backend.base_backend import UnsupportedByBackendError
from tests.server.conftest import API_KEY, start_server, stop_server, wait_idle


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    srv = start_server(tiny_llama_dir, tmp_path_factory.mktemp("lang_server") / "server.log",
                       "--max-running-requests", "16", "--max-queued-requests", "64")
    yield srv
    stop_server(srv)


@pytest.fixture
def endpoint(server):
    backend = sgl.RuntimeEndpoint(server.base_url, api_key=API_KEY)
    yield backend
    with server.client() as client:
        info = wait_idle(client)
    assert info["free_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]
    backend.shutdown()


@pytest.fixture
def openai_backend(server):
    models = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    return sgl.OpenAI(models["data"][0]["id"], base_url=f"{server.base_url}/v1", api_key=API_KEY)


@sgl.function
def planner(s, goal):
    s += sgl.system("You plan tasks.")
    s += sgl.user(f"Goal: {goal}. How hard is it?")
    s += sgl.assistant("It is " + sgl.select("level", ["easy", "hard", "impossible"]))
    s += sgl.user("How many steps?")
    s += sgl.assistant(sgl.gen_int("steps", max_tokens=4))
    forks = s.fork(2)
    forks += lambda i: sgl.user(f"Idea {i}?") + sgl.assistant(sgl.gen("idea", max_tokens=6))
    forks.join()
    with s.var_scope("summary"):
        s += sgl.user("Summary?") + sgl.assistant(sgl.gen("short", max_tokens=5, stop=["\n"]))


def test_same_greedy_results_on_engine_and_runtime_endpoint(engine, endpoint):
    goals = [{"goal": g} for g in ("paint a fence", "learn Rust", "bake bread")]
    local = planner.run_batch(goals, backend=engine, temperature=0)
    remote = planner.run_batch(goals, backend=endpoint, temperature=0)
    for a, b in zip(local, remote, strict=True):
        assert a.error() is None and b.error() is None
        assert a.text() == b.text()
        for name in ("level", "steps", "idea", "summary", "short"):
            assert a[name] == b[name]
        assert a.get_meta_info("level")["normalized_prompt_logprobs"] == pytest.approx(
            b.get_meta_info("level")["normalized_prompt_logprobs"], abs=1e-4)
    streamed = planner.run(goal="bake bread", backend=endpoint, stream=True, temperature=0)
    assert "".join(streamed.text_iter()) == remote[2].text()
    assert sgl.flush_cache(endpoint) is True and "num_prompt_tokens" in sgl.get_server_info(endpoint)


@sgl.function
def chat(s, question):
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))
    s += sgl.user("Again, shorter.")
    s += sgl.assistant(sgl.gen("again", max_tokens=6))


def test_openai_backend_matches_the_native_endpoint(endpoint, openai_backend):
    remote = chat.run(question="What is a radix tree?", backend=endpoint, temperature=0)
    via_openai = chat.run(question="What is a radix tree?", backend=openai_backend, temperature=0)
    assert via_openai["answer"] == remote["answer"] and via_openai["again"] == remote["again"]
    assert via_openai.messages() == remote.messages()
    assert via_openai.get_meta_info("again")["completion_tokens"] == remote.get_meta_info("again")["completion_tokens"]

    @sgl.function
    def plain(s):
        s += "Once upon a time" + sgl.gen("story", max_tokens=6)

    assert plain.run(backend=openai_backend, temperature=0)["story"] == plain.run(backend=endpoint,
                                                                                  temperature=0)["story"]
    streamed = plain.run(backend=openai_backend, temperature=0, stream=True)
    assert "".join(streamed.text_iter("story")) == streamed["story"]


@pytest.mark.parametrize(
    "expr, param",
    [
        (lambda: sgl.select("c", ["yes", "no"]), "choices"),
        (lambda: sgl.gen("c", choices=["yes", "no"]), "choices"),
        (lambda: sgl.gen("c", regex=r"[0-9]+"), "regex"),
        (lambda: sgl.gen_int("c"), "regex"),
    ],
)
def test_openai_backend_refuses_what_the_api_cannot_serve(openai_backend, expr, param):
    @sgl.function
    def prog(s):
        s += sgl.user("Pick.")
        s += sgl.assistant(expr())

    with pytest.raises(UnsupportedByBackendError) as info:
        prog.run(backend=openai_backend)
    assert info.value.param == param
