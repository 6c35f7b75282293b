"""`ReasoningParser` (qwen3, deepseek-r1) over every chunking, the mode read from the prompt, and the
grammar that constrains only what follows the reasoning (`runtime/reasoning_grammar.py`); no server."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from arborlm.constrained.grammar_spec import grammar_spec_from_params
from arborlm.constrained.keys import GrammarError
from arborlm.constrained.xgrammar_backend import structural_tag_json
from arborlm.entrypoints.openai.reasoning_parser import (
    SYNTAXES,
    ReasoningMode,
    ReasoningParser,
    reasoning_mode,
    split_reasoning,
)
from arborlm.runtime.reasoning_grammar import AfterReasoning, after_reasoning
from arborlm.sampling_params import SamplingParams

QWEN_OPENS = ReasoningMode(SYNTAXES["qwen3"], inside=False)
R1_INSIDE = ReasoningMode(SYNTAXES["deepseek-r1"], inside=True)

# (mode, output, reasoning, content)
CASES = [
    (QWEN_OPENS, "<think>\nLet me think.\n</think>\n\nThe answer.", "\nLet me think.\n", "The answer."),
    (QWEN_OPENS, "\n<think>a</think>b", "a", "b"),
    (QWEN_OPENS, "No thinking here.", None, "No thinking here."),
    (QWEN_OPENS, "<thin", None, "<thin"),  # cut inside a start marker that never came: text
    (QWEN_OPENS, "<think>cut by max_tokens", "cut by max_tokens", ""),
    (QWEN_OPENS, "<think>cut at </thi", "cut at </thi", ""),
    (QWEN_OPENS, "<think></think>", "", ""),
    (QWEN_OPENS, "<think>x</think>\n\n", "x", ""),
    (QWEN_OPENS, 'Text then <think>not reasoning</think>', None, "Text then <think>not reasoning</think>"),
    (QWEN_OPENS, "<think>a</think>b</think>c", "a", "b</think>c"),
    (R1_INSIDE, "I think.</think>\n\n42", "I think.", "42"),
    (R1_INSIDE, "<think>\nI think.</think>42", "\nI think.", "42"),
    (R1_INSIDE, "no end yet", "no end yet", ""),
    (R1_INSIDE, "", "", ""),
]


@pytest.mark.parametrize("mode, text, reasoning, content", CASES, ids=[repr(c[1])[:30] for c in CASES])
def test_whole_output(mode, text, reasoning, content):
    parser = split_reasoning(mode, text)
    assert (parser.reasoning, parser.content) == (reasoning, content)


@pytest.mark.parametrize("mode, text, reasoning, content", CASES, ids=[repr(c[1])[:30] for c in CASES])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_chunking_gives_the_same_split(mode, text, reasoning, content, data):
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=10))))
    for chunking in (cuts, list(range(len(text)))):
        parser, got, last = ReasoningParser(mode), [], 0
        for cut in [*chunking, len(text)]:
            got.append(parser.feed(text[last:cut]))
            last = cut
        got.append(parser.finish())
        assert "".join(d.reasoning for d in got) == (reasoning or "")
        assert "".join(d.content for d in got) == content
        assert (parser.reasoning, parser.content) == (reasoning, content)


@settings(max_examples=200, deadline=None)
@given(body=st.lists(st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "\n", " ", "a"]), max_size=12),
       inside=st.booleans(), data=st.data())
def test_random_marker_soup_splits_the_same_in_pieces(body, inside, data):
    text = "".join(body)
    mode = R1_INSIDE if inside else QWEN_OPENS
    whole = split_reasoning(mode, text)
    parser, last, reasoning, content = ReasoningParser(mode), 0, "", ""
    for cut in sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))) + [len(text)]:
        d = parser.feed(text[last:cut])
        reasoning, content, last = reasoning + d.reasoning, content + d.content, cut
    d = parser.finish()
    assert (reasoning + d.reasoning, content + d.content) == (whole.reasoning or "", whole.content)
    if whole.reasoning is not None:  # the reasoning ends at the first end marker, which goes to neither side
        assert "</think>" not in whole.reasoning


@pytest.mark.parametrize("name, prompt, expected", [
    ("qwen3", "<|im_start|>assistant\n", QWEN_OPENS),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", None),  # enable_thinking=false
    ("qwen3", "<|im_start|>assistant\n<think>\n", ReasoningMode(SYNTAXES["qwen3"], inside=True)),
    ("deepseek-r1", "<｜Assistant｜><think>\n", R1_INSIDE),
    ("deepseek-r1", "<｜Assistant｜>", R1_INSIDE),
    (None, "<|im_start|>assistant\n", None),
])
def test_mode_comes_from_how_the_prompt_ends(name, prompt, expected):
    assert reasoning_mode(name, prompt) == expected


SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


def _spec(params: dict, mode: ReasoningMode):
    sampling = SamplingParams(**params, reasoning=mode.grammar_reasoning())
    sampling.verify(100)
    return after_reasoning(grammar_spec_from_params(sampling, "xgrammar"), sampling.reasoning, "xgrammar")


def _accepts(spec, text: str) -> bool:
    grammar = xgr.Grammar.from_structural_tag(structural_tag_json(spec.key.text))
    return xgr.testing._is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize("mode, opening", [(QWEN_OPENS, "<think>"), (R1_INSIDE, "")])
def test_schema_constrains_only_what_follows_the_reasoning(mode, opening):
    spec = _spec({"json_schema": SCHEMA}, mode)
    assert isinstance(spec, AfterReasoning) and spec.param == "json_schema" and spec.schema is not None
    free = f'{opening}any {{"answer": "maybe"}} text\n</think>\n\n'
    assert _accepts(spec, free + '{"answer": "yes"}')
    assert not _accepts(spec, free + '{"answer": "maybe"}')
    assert not _accepts(spec, '{"answer": "yes"}')  # no reasoning: refused
    assert spec.validate_output(free + '{"answer": "no"}') is None
    assert "answer" in spec.validate_output(free + '{"answer": "maybe"}')
    assert "no end of reasoning" in spec.validate_output(f'{opening}still thinking')


@pytest.mark.parametrize("params, good, bad", [
    ({"regex": "[0-9]+"}, "42", "4a"),
    ({"json_schema": "$$ANY$$"}, "[1, 2]", "[1,"),
    ({"ebnf": 'root ::= "yes" | "no"'}, "no", "maybe"),
    ({"structural_tag": {"type": "const_string", "value": "done"}}, "done", "dome"),
])
def test_every_constraint_kind_moves_after_the_reasoning(params, good, bad):
    spec = _spec(params, QWEN_OPENS)
    assert _accepts(spec, "<think>hm</think>\n\n" + good) and not _accepts(spec, "<think>hm</think>\n\n" + bad)


def test_no_constraint_or_no_reasoning_leaves_the_spec():
    assert after_reasoning(None, QWEN_OPENS.grammar_reasoning(), "xgrammar") is None
    spec = grammar_spec_from_params(SamplingParams(regex="a"), "xgrammar")
    assert after_reasoning(spec, None, "xgrammar") is spec
    with pytest.raises(GrammarError) as e:
        after_reasoning(spec, QWEN_OPENS.grammar_reasoning(), "outlines")
    assert e.value.param == "regex"


@pytest.mark.parametrize("value", [{"end": ""}, {"begin": "<think>"}, {"end": "x", "other": "y"}, "</think>",
                                   {"end": 3}])
def test_bad_reasoning_field_is_an_invalid_request(value):
    from arborlm.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(regex="a", reasoning=value).verify(100)
    assert e.value.param == "reasoning"


def test_after_reasoning_keeps_json_text_exact():
    spec = _spec({"json_schema": SCHEMA}, QWEN_OPENS)
    assert spec.answer_text('<think>x</think>\n\n{"answer": "yes"}') == '{"answer": "yes"}'
    assert json.loads(spec.key.text)["format"]["type"] == "sequence"
