"""Tracing, prefix detection, the choices methods and the interpreter's control flow, with no model."""

from __future__ import annotations

import asyncio
import threading

import pytest

import arborlm as sgl
from arborlm.chat_template import ChatTemplate
from arborlm.frontend_lang.backend.base_backend import BaseBackend, UnsupportedByBackendError
from arborlm.frontend_lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from arborlm.frontend_lang.literals import DTYPE_REGEX

TEMPLATE = ChatTemplate({"system": ("<s>", "</s>"), "user": ("<u>", "</u>"), "assistant": ("<a>", "</a>")})


class FakeBackend(BaseBackend):
    """Answers "ok" (or `answers[i]` for the i-th call), records calls and prefills; no model."""

    def __init__(self, answer: str = "ok", fail_on: str | None = None):
        self.answer = answer
        self.fail_on = fail_on
        self.calls: list[tuple[str, dict]] = []
        self.prefills: list[str] = []
        self.lock = threading.Lock()

    def get_chat_template(self) -> ChatTemplate:
        return TEMPLATE

    def generate(self, text, sampling_params, **options):
        if self.fail_on is not None and self.fail_on in text:
            raise ValueError(f"refused {self.fail_on}")
        with self.lock:
            self.calls.append((text, dict(sampling_params)))
        return self.answer, {"prompt_tokens": len(text), "completion_tokens": 1, "cached_tokens": 0,
                             "finish_reason": {"type": "stop"}}

    def prefill(self, text):
        with self.lock:
            self.prefills.append(text)
        return {"prompt_tokens": len(text), "cached_tokens": 0}


@sgl.function
def qa(s, question, context="none"):
    s += sgl.system("You answer questions.")
    s += sgl.user(f"Context: {context}\nQuestion: {question}")
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))
    if s["answer"] == "yes":
        s += "!"


def test_trace_records_nodes_and_stops_at_generated_values():
    traced = qa.trace(chat_template=TEMPLATE)
    kinds = [(n.kind, n.value) for n in traced.nodes]
    assert kinds == [
        ("role_begin", "system"), ("text", "You answer questions."), ("role_end", "system"),
        ("role_begin", "user"), ("text", "Context: "), ("argument", "context"), ("text", "\nQuestion: "),
        ("argument", "question"), ("role_end", "user"),
        ("role_begin", "assistant"), ("gen", "answer"), ("role_end", "assistant"),
    ]
    assert not traced.complete and "answer" in traced.stop_reason  # the `if` on a generated value
    assert traced.prefix == "<s>You answer questions.</s><u>Context: "


@pytest.mark.parametrize(
    "kwargs, prefix",
    [
        ({}, "<s>You answer questions.</s><u>Context: "),
        ({"context": "docs"}, "<s>You answer questions.</s><u>Context: docs\nQuestion: "),
        ({"context": "docs", "question": "why?"}, "<s>You answer questions.</s><u>Context: docs\nQuestion: why?</u><a>"),
    ],
)
def test_prefix_grows_with_the_given_arguments(kwargs, prefix):
    assert qa.trace(chat_template=TEMPLATE, **kwargs).prefix == prefix
    assert qa.bind(**kwargs).trace(chat_template=TEMPLATE).prefix == prefix


@pytest.mark.parametrize(
    "body, prefix",
    [
        (lambda s, x: s.__iadd__("A" + x + "B"), "A"),              # str + argument
        (lambda s, x: s.__iadd__(x.upper()), ""),                   # a method needs the value
        (lambda s, x: s.__iadd__("A" + sgl.gen("g") + x), "A"),     # a gen ends the prefix
        (lambda s, x: (s.__iadd__("A"), s.fork(2)), "A"),          # fork ends tracing
        (lambda s, x: s.__iadd__(sgl.user("U") + "C" + sgl.select("c", ["a", "b"])), "<u>U</u>C"),
    ],
)
def test_prefix_detection_table(body, prefix):
    @sgl.function
    def prog(s, x):
        body(s, x)

    assert prog.trace(chat_template=TEMPLATE).prefix == prefix


def test_run_batch_prefills_the_shared_prefix_once_and_keeps_input_order():
    backend = FakeBackend()
    states = qa.run_batch([{"question": f"q{i}", "context": "shared"} for i in range(8)], backend=backend,
                          num_threads=4, temperature=0)
    assert backend.prefills == ["<s>You answer questions.</s><u>Context: shared\nQuestion: "]
    assert [s.text().split("Question: ")[1].split("<")[0] for s in states] == [f"q{i}" for i in range(8)]
    assert all(call[1] == {"temperature": 0, "max_new_tokens": 8} for call in backend.calls)


def test_failing_batch_item_does_not_stop_the_others():
    backend = FakeBackend(fail_on="bad")
    states = qa.run_batch([{"question": "good"}, {"question": "bad"}, {"question": "fine"}], backend=backend,
                          progress_bar=True)
    assert [s.error() is None for s in states] == [True, False, True]
    assert "refused bad" in str(states[1].error())
    assert states[0]["answer"] == "ok" and states[2]["answer"] == "ok"


def test_error_names_the_program_line():
    @sgl.function
    def prog(s):
        s += "bad " + sgl.gen("x")

    with pytest.raises(ValueError, match="refused bad") as info:
        prog.run(backend=FakeBackend(fail_on="bad"))
    assert any('test_tracer.py' in note and 's += "bad " + sgl.gen("x")' in note for note in info.value.__notes__)


def test_fork_join_var_scope_and_group_append():
    backend = FakeBackend("A")

    @sgl.function
    def prog(s):
        s += sgl.user("Q")
        forks = s.fork(3)
        forks += lambda i: f"[{i}]" + sgl.gen("g")
        assert [f["g"] for f in forks] == ["A", "A", "A"]
        assert forks[1].text() == "<u>Q</u>[1]A"
        forks.join()
        with s.var_scope("tail"):
            s += "T" + sgl.gen("h")
        branches = s.fork(2)
        branches += "+"
        branches.join("concate_and_append")

    state = prog.run(backend=backend)
    assert backend.prefills == ["<u>Q</u>", "<u>Q</u>TA"]
    assert state["g"] == ["A", "A", "A"] and len(state.get_meta_info("g")) == 3
    assert state["tail"] == "TA"
    assert state.text() == "<u>Q</u>TA++"


def test_dtype_and_gen_variants_become_regexes():
    assert sgl.gen_int("n").sampling["regex"] == DTYPE_REGEX[int]
    assert sgl.gen("b", dtype="bool").sampling["regex"] == "(True|False)"
    assert sgl.gen_string("s").sampling["regex"].startswith('"')
    assert isinstance(sgl.gen("c", choices=["x", "y"]), type(sgl.select("c", ["x", "y"])))
    with pytest.raises(sgl.gen.__globals__["InvalidRequestError"]):
        sgl.gen("x", dtype=list)
    with pytest.raises(ValueError, match="regex"):
        sgl.gen("x", regex="(")


def test_streaming_with_the_default_single_chunk():
    @sgl.function
    def prog(s):
        s += "Hi " + sgl.gen("x")

    state = prog.run(backend=FakeBackend("there"), stream=True)
    assert "".join(state.text_iter()) == "Hi there"
    assert list(state.text_iter("x")) == ["there"]

    async def collect():
        return [p async for p in state.text_async_iter("x", return_meta_data=True)]

    pieces = asyncio.run(collect())
    assert pieces[0][0] == "there" and pieces[0][1]["completion_tokens"] == 1


def test_select_without_scoring_is_a_clear_error():
    @sgl.function
    def prog(s):
        s += "Pick: " + sgl.select("c", ["a", "b"])

    with pytest.raises(UnsupportedByBackendError, match="select"):
        prog.run(backend=FakeBackend())


def test_compile_keeps_the_trace():
    compiled = qa.bind(context="c").compile(backend=FakeBackend())
    assert compiled.prefix.endswith("Context: c\nQuestion: ")
    assert compiled.run(question="q")["answer"] == "ok"


# ---- the choices methods, on hand-made logprobs ------------------------------------------

def lps(*values):
    return [(v, i, None) for i, v in enumerate(values)]


@pytest.mark.parametrize(
    "method, input_lps, uncond, expected",
    [
        (token_length_normalized, [lps(-1.0, -1.0), lps(-0.5, -3.0), lps(-0.9)], None, 2),
        (greedy_token_selection, [lps(-1.0, -1.0), lps(-0.5, -3.0), lps(-0.9)], None, 1),
        # "a" is a prefix of "a b": padded with its mean, it loses at position 2.
        (greedy_token_selection, [lps(-0.5), lps(-0.5, -0.1)], None, 1),
        (unconditional_likelihood_normalized, [lps(-1.0, -1.0), lps(-2.0, -2.0)],
         [lps(None, -3.0), lps(None, -0.1)], 0),
    ],
)
def test_choices_methods(method, input_lps, uncond, expected):
    choices = [f"c{i}" for i in range(len(input_lps))]
    normalized = [sum(v for v, _, _ in x) / len(x) for x in input_lps]
    decision = method(choices=choices, normalized_prompt_logprobs=normalized, input_token_logprobs=input_lps,
                      output_token_logprobs=[[] for _ in choices], unconditional_token_logprobs=uncond)
    assert decision.decision == choices[expected]
    assert decision.meta_info["normalized_prompt_logprobs"] == normalized
