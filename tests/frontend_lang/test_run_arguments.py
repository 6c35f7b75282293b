"""A program's keyword arguments are checked when it is called, as Python checks a call: a
misspelt argument is a TypeError naming it, a sampling default of the wrong type fails at once,
even when every gen overrides it (SGLang users meet these before any request is sent)."""

from __future__ import annotations

import pytest

import arborlm as sgl
from arborlm.errors import InvalidRequestError
from tests.frontend_lang.test_sglang_surface import Fake


@sgl.function
def q(s, question):
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=4)


@pytest.mark.parametrize("call", [
    lambda b: q.run(question="x", questoin="y", backend=b),
    lambda b: q(question="x", questoin="y", backend=b),
    lambda b: q.run(questoin="y", backend=b),
    lambda b: q.run_batch([{"question": "x"}, {"questoin": "y"}], backend=b),
    lambda b: q.bind(question="x").run(questoin="y", backend=b),
])
def test_a_misspelt_argument_is_a_type_error_naming_it(call):
    backend = Fake("ok")
    with pytest.raises(TypeError, match=r"q\(\) got an unexpected keyword argument 'questoin'"):
        call(backend)
    assert backend.calls == []  # nothing was sent


@pytest.mark.parametrize("kwargs, param", [
    ({"max_new_tokens": "x"}, "max_new_tokens"),
    ({"max_tokens": 2.5}, "max_new_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"stop": 5}, "stop"),
    ({"ignore_eos": "no"}, "ignore_eos"),
])
def test_a_bad_sampling_default_fails_the_call_even_when_each_gen_overrides_it(kwargs, param):
    backend = Fake("ok")
    with pytest.raises(InvalidRequestError) as info:
        q.run(question="x", backend=backend, **kwargs)
    assert info.value.param == param and backend.calls == []
    with pytest.raises(InvalidRequestError):
        q.run_batch([{"question": "x"}], backend=backend, **kwargs)


def test_good_arguments_still_run():
    backend = Fake(" Paris")
    state = q.run(question="Capital?", max_new_tokens=8, temperature=0, return_logprob=True, backend=backend)
    assert state["answer"] == " Paris"
    assert backend.calls[0]["sampling"]["temperature"] == 0 and backend.calls[0]["options"]["return_logprob"]
    assert [s["answer"] for s in q.run_batch([{"question": "a"}, ("b",)], max_tokens=3, backend=backend)] == \
        [" Paris", " Paris"]


def test_sglangs_use_thread_is_accepted_and_gives_the_same_result():
    backend = Fake(" Paris")
    states = [q.run(question="Capital?", use_thread=flag, backend=backend) for flag in (True, False)]
    assert states[0].text() == states[1].text() == "Q: Capital?\nA: Paris"
    with pytest.raises(TypeError, match="use_thread must be a bool"):
        q.run(question="x", use_thread="no", backend=backend)
