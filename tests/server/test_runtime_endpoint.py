"""`RuntimeEndpoint`: DSL programs against the folder's shared tiny-model server (conftest.py)
give what the in-process Engine gives on the same model under greedy decoding."""

from __future__ import annotations

import pytest

import arborlm
from arborlm.errors import ArborError, InvalidRequestError
from arborlm.frontend_lang.backend.engine_backend import EngineBackend
from tests.server.conftest import API_KEY


@arborlm.function
def interview(s, question, stop=None):
    s += arborlm.system("You are terse.")
    s += arborlm.user(question + " Once upon a time" + arborlm.gen("story", max_tokens=12, stop=stop))
    s += arborlm.assistant(arborlm.gen("answer", max_tokens=6))
    s += arborlm.user("Pick a number.")
    s += arborlm.assistant(arborlm.gen("number", max_tokens=8, regex=r"[0-9]{1,3}"))
    s += "\nAnd a colour: " + arborlm.gen("colour", max_tokens=6, choices=["red", "green", "blue"])


@pytest.fixture
def endpoint(http, server):
    backend = arborlm.RuntimeEndpoint(server.base_url, api_key=API_KEY)
    yield backend
    backend.shutdown()


def test_program_matches_the_engine_backend(endpoint, engine):
    question = "Tell me a story."
    story = interview.run(question=question, backend=engine, temperature=0)["story"]
    assert len(story.strip()) > 4
    stop = story.strip()[2:4]  # a stop string the story runs into, whatever the random model writes
    remote = interview.run(question=question, stop=[stop], backend=endpoint, temperature=0)
    local = interview.run(question=question, stop=[stop], backend=engine, temperature=0)
    assert endpoint.get_chat_template() == EngineBackend(engine).get_chat_template()
    assert remote.text() == local.text()
    assert remote.messages() == local.messages()
    for name in ("story", "answer", "number", "colour"):
        assert remote[name] == local[name]
        assert remote.get_meta_info(name)["completion_tokens"] == local.get_meta_info(name)["completion_tokens"]
    assert remote["story"] == story[:story.index(stop)]
    assert remote.get_meta_info("story")["matched_stop"] == stop
    assert remote["number"].isdigit() and remote["colour"] in ("red", "green", "blue")
    assert remote.get_meta_info("number")["cached_tokens"] > 0  # the program prefix came from the radix cache


def test_stream_pieces_join_to_the_text(endpoint):
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    text, meta = endpoint.generate("Once upon a time", params)
    pieces = list(endpoint.generate_stream("Once upon a time", params))
    assert "".join(pieces) == text and len(pieces) > 1 and meta["completion_tokens"] == 10


def test_server_errors_are_typed(endpoint, server):
    with pytest.raises(InvalidRequestError) as excinfo:
        endpoint.generate("x", {"top_k": 0})
    assert excinfo.value.param == "top_k"
    with pytest.raises(InvalidRequestError) as excinfo:
        list(endpoint.generate_stream("x", {"regex": "("}))
    assert excinfo.value.param == "regex"
    with pytest.raises(ArborError, match="401"):
        arborlm.RuntimeEndpoint(server.base_url, api_key="wrong")
    assert endpoint.get_server_info()["num_running_reqs"] == 0
