"""The same programs on the Engine, on `RuntimeEndpoint` and on the `OpenAI` backend against one
arborlm server on the tiny model, started from Python with `sgl.Runtime` (one server for this
module): same greedy results, clear refusals."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import pytest

import arborlm as sgl
from arborlm.frontend_lang.backend.base_backend import UnsupportedByBackendError
from tests.server.conftest import API_KEY, wait_idle


@dataclass
class Server:
    runtime: object
    base_url: str

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    runtime = sgl.Runtime(model_path=str(tiny_llama_dir), dtype="float32", max_total_tokens=8192, random_seed=1234,
                          log_level="warning", api_key=API_KEY, max_running_requests=16, max_queued_requests=64)
    yield Server(runtime, runtime.url)
    runtime.shutdown()
    assert runtime._process is None


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


@sgl.function
def typed(s):
    s += "City facts.\n"
    with s.var_scope("json_output"):
        s += '{"name": ' + sgl.gen_string("name", max_tokens=8) + ', "population": ' + sgl.gen_int("population", max_tokens=8)
        s += "}"
    s += "\nEnd." + sgl.gen("tail", max_tokens=16, ignore_eos=True, stop_regex=r"[a-z]{3}")


def test_runtime_is_a_backend_and_runs_programs_as_the_engine_does(engine, server):
    runtime = server.runtime
    local = typed.run(backend=engine, temperature=0)
    remote = typed(backend=runtime, temperature=0)
    assert remote.text() == local.text() and remote["tail"] == local["tail"]
    assert remote.get_meta_info("tail")["finish_reason"] == local.get_meta_info("tail")["finish_reason"]
    runtime.token_usage.reset()
    again = typed.run(backend=runtime, temperature=0)
    metas = [again.get_meta_info(n) for n in ("name", "population", "tail")]
    assert runtime.token_usage.prompt_tokens == sum(m["prompt_tokens"] for m in metas)
    assert runtime.token_usage.completion_tokens == sum(m["completion_tokens"] for m in metas)
    answer = json.loads(runtime.generate("Hello", {"max_new_tokens": 3, "temperature": 0}))
    assert answer["meta_info"]["completion_tokens"] == 3
    assert runtime.get_server_info()["num_prompt_tokens"] > 0 and runtime.flush_cache() is True
    assert runtime.get_tokenizer()("Hello").input_ids == engine.tokenizer("Hello").input_ids


def test_runtime_endpoint_chat_template_name_verify_and_logprob_text(server, endpoint):
    named = sgl.RuntimeEndpoint(server.base_url, api_key=API_KEY, chat_template_name="llama-3-instruct", verify=False)
    try:
        assert named.get_chat_template().prefix("user") == "<|start_header_id|>user<|end_header_id|>\n\n"
        assert endpoint.get_chat_template().prefix("user") == "<|im_start|>user\n"  # the served model's own

        @sgl.function
        def qa(s):
            s += sgl.user("Hi") + sgl.assistant(sgl.gen("a", max_tokens=3, ignore_eos=True, return_logprob=True,
                                                        return_text_in_logprobs=True))

        state = qa.run(backend=named, temperature=0)
        assert state.text().startswith("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>")
        triples = state.get_meta_info("a")["output_token_logprobs"]
        assert len(triples) == 3 and all(isinstance(text, str) for _, _, text in triples)
        assert "".join(text for _, _, text in triples) == state["a"]
    finally:
        named.shutdown()
    with pytest.raises(ValueError, match="chat_template"):
        sgl.RuntimeEndpoint(server.base_url, api_key=API_KEY, chat_template_name="no-such-template")


def test_openai_backend_as_a_completion_model_and_its_token_usage(endpoint, openai_backend, server):
    models = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    instruct = sgl.OpenAI(models["data"][0]["id"], is_chat_model=False, base_url=f"{server.base_url}/v1",
                          api_key=API_KEY)

    @sgl.function
    def turn(s):
        s += sgl.user("Name a colour.")
        s += sgl.assistant("Sure: " + sgl.gen("colour", max_tokens=5))

    as_text = turn.run(backend=instruct, temperature=0)  # a text completion of the program text
    assert as_text["colour"] == turn.run(backend=endpoint, temperature=0)["colour"]
    openai_backend.token_usage.reset()
    state = chat.run(question="Why?", backend=openai_backend, temperature=0)
    metas = [state.get_meta_info("answer"), state.get_meta_info("again")]
    assert openai_backend.token_usage.prompt_tokens == sum(m["prompt_tokens"] for m in metas) > 0
    assert openai_backend.token_usage.completion_tokens == sum(m["completion_tokens"] for m in metas)
