"""SGLang's test/lang/test_bind_cache.py: `bind(...).trace().last_node.print_graph_dfs()`,
`SglFunction.cache(backend)` and `compile(...).print_graph()`, on a recording fake backend."""

from __future__ import annotations

import re

import pytest

import arborlm as sgl
from tests.frontend_lang.test_sglang_surface import Fake


@sgl.function
def few_shot_qa(s, prompt, question):
    s += prompt
    s += "Q: What is the capital of France?\n"
    s += "A: Paris\n"
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n")


PROMPT = "The following are questions with answers.\n\n"


def test_bind_trace_last_node_prints_the_graph_in_order():
    graph = few_shot_qa.bind(prompt=PROMPT).trace().last_node.print_graph_dfs()
    lines = graph.splitlines()
    assert lines[0] == f"%0 = Constant({PROMPT!r})"
    assert all(re.fullmatch(rf"%{i} = %{i - 1} \+ .+", line) for i, line in enumerate(lines[1:], 1))
    assert "Argument('question')" in lines[4] and lines[-1].endswith("Gen('answer')")
    assert len(lines) == 8  # prompt, 3 constants, the question and its "\n", "A:", the gen
    assert few_shot_qa.trace().last_node.print_graph_dfs().startswith("%0 = Argument('prompt')")
    assert sgl.function(lambda s: None).trace().last_node is None


def test_cache_prefills_the_bound_prefix_on_the_given_backend():
    backend = Fake("Paris")
    bound = few_shot_qa.bind(prompt="Answer as if you were a 5-year-old kid.\n\n")
    meta = bound.cache(backend)
    [call] = backend.calls
    assert call["prefill"] and call["text"] == ("Answer as if you were a 5-year-old kid.\n\n"
                                                "Q: What is the capital of France?\nA: Paris\nQ: ")
    assert meta["prompt_tokens"] == len(call["text"])
    assert few_shot_qa.cache(backend) is None and len(backend.calls) == 1  # no constant prefix: nothing sent


def test_cache_without_a_backend_raises(monkeypatch):
    monkeypatch.setattr(sgl.global_config, "default_backend", None)
    with pytest.raises(ValueError, match="no backend"):
        few_shot_qa.cache()


def test_compiled_print_graph(capsys):
    compiled = few_shot_qa.bind(prompt=PROMPT).compile(backend=Fake())
    compiled.print_graph()
    out = capsys.readouterr().out
    assert out == compiled.last_node.print_graph_dfs() and out.count("\n") == 8
