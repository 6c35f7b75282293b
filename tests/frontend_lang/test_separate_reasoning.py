"""`sgl.separate_reasoning` (SGLang's signature): a gen's thinking goes to `<name>_reasoning_content`,
its answer to `<name>`; the program's text keeps both. Fake backend, no model."""

from __future__ import annotations

import pytest

import arborlm as sgl
from arborlm.chat_template import ChatTemplate
from arborlm.frontend_lang.backend.base_backend import BaseBackend, StreamChunk


class ThinkingBackend(BaseBackend):
    """Answers `answer`, streamed in pieces of 3 characters."""

    def __init__(self, answer: str):
        self.answer = answer

    def get_chat_template(self) -> ChatTemplate:
        return ChatTemplate({"system": ("", "\n"), "user": ("U: ", "\n"), "assistant": ("A: ", "\n")})

    def generate(self, text, sampling_params):
        return self.answer, {"finish_reason": {"type": "stop"}}

    def stream(self, text, sampling_params):
        for i in range(0, len(self.answer), 3):
            yield StreamChunk(self.answer[i:i + 3], None)
        yield StreamChunk("", {"finish_reason": {"type": "stop"}})


@sgl.function
def ask(s, model_type):
    s += sgl.user("Is Paris in France?")
    s += sgl.assistant(sgl.separate_reasoning(sgl.gen("answer", max_tokens=32), model_type=model_type))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model_type, output, reasoning, answer", [
    ("qwen3", "<think>Surely.</think>\n\nYes.", "Surely.", "Yes."),
    ("qwen3", "Yes.", "", "Yes."),
    ("deepseek-r1", "Surely.</think>Yes.", "Surely.", "Yes."),
])
def test_reasoning_is_split_off(stream, model_type, output, reasoning, answer):
    state = ask.run(model_type=model_type, backend=ThinkingBackend(output), stream=stream)
    if stream:
        "".join(state.text_iter())
    assert state["answer"] == answer
    assert state["answer_reasoning_content"] == reasoning
    assert state.text().endswith(f"A: {output}\n")  # the program's text keeps the whole output


def test_separate_reasoning_inside_a_concatenation():
    expr = sgl.separate_reasoning("Answer: " + sgl.gen("a"), model_type="qwen3")
    assert [e.reasoning_parser for e in expr.exprs if hasattr(e, "reasoning_parser")] == ["qwen3"]


@pytest.mark.parametrize("args, error", [
    ((sgl.gen("a"), "o1"), ValueError),
    ((sgl.gen("a"), None), ValueError),
    ((sgl.gen(), "qwen3"), ValueError),
    (("text only", "qwen3"), TypeError),
])
def test_bad_arguments(args, error):
    with pytest.raises(error):
        sgl.separate_reasoning(*args)
