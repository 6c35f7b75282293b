"""The @function DSL on the tiny model: roles, gen, variables, meta info and prefix reuse."""

from __future__ import annotations

import pytest

import arborlm as sgl
from arborlm.chat_template import ChatTemplate
from arborlm.errors import InvalidRequestError
from arborlm.frontend_lang.backend.base_backend import BaseBackend


class RecordingBackend(BaseBackend):
    """A fake backend that answers a fixed string and records every call (no model)."""

    def __init__(self, answer: str = "ok"):
        self.answer = answer
        self.calls: list[tuple[str, dict]] = []

    def get_chat_template(self) -> ChatTemplate:
        return ChatTemplate({"system": ("<s>", "</s>"), "user": ("<u>", "</u>"), "assistant": ("<a>", "</a>")})

    def generate(self, text, sampling_params):
        self.calls.append((text, dict(sampling_params)))
        return self.answer, {"prompt_tokens": len(text), "completion_tokens": 1, "cached_tokens": 0,
                             "finish_reason": {"type": "stop"}}


@sgl.function
def two_turns(s, question):
    s += sgl.system("Be brief.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("first", max_tokens=4))
    s += sgl.user("And then?")
    s += sgl.assistant(sgl.gen("second", max_tokens=5, temperature=0.5, stop=["\n"]))


def test_program_text_roles_and_variables_with_fake_backend():
    backend = RecordingBackend("A")
    state = two_turns.run(question="Why?", backend=backend)
    assert state.text() == "<s>Be brief.</s><u>Why?</u><a>A</a><u>And then?</u><a>A</a>"
    assert state["first"] == "A" and state["second"] == "A"
    assert state.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "A"},
    ]
    # Each gen sends the whole program text so far.
    assert backend.calls[0][0] == "<s>Be brief.</s><u>Why?</u><a>"
    assert backend.calls[1][0].startswith(backend.calls[0][0] + "A</a>")
    assert backend.calls[0][1] == {"max_new_tokens": 4}
    assert backend.calls[1][1] == {"max_new_tokens": 5, "temperature": 0.5, "stop": ["\n"]}


def test_run_sampling_defaults_and_with_role_blocks():
    @sgl.function
    def prog(s):
        with s.user():
            s += "Hi " + sgl.gen("x")
        s += sgl.gen("y", temperature=1.0)

    backend = RecordingBackend()
    prog.run(backend=backend, temperature=0, max_new_tokens=3)
    assert backend.calls[0][1] == {"temperature": 0, "max_new_tokens": 3}
    assert backend.calls[1][1] == {"temperature": 1.0, "max_new_tokens": 3}


def test_nested_function_and_bind():
    @sgl.function
    def inner(s, word):
        s += f"[{word}]"

    @sgl.function
    def outer(s, word):
        inner(s, word)
        s += sgl.gen("g")

    state = outer.bind(word="w").run(backend=RecordingBackend("!"))
    assert state.text() == "[w]!"


@pytest.mark.parametrize(
    "body, error",
    [
        (lambda s: s.__iadd__(42), TypeError),
        (lambda s: s.__iadd__(sgl.system("a") + sgl.user(sgl.system("b"))), ValueError),
    ],
)
def test_program_errors_are_typed(body, error):
    @sgl.function
    def prog(s):
        body(s)

    with pytest.raises(error):
        prog.run(backend=RecordingBackend())


def test_run_without_backend_is_clear_error():
    @sgl.function
    def prog(s):
        s += "x"

    previous = sgl.get_default_backend()
    try:
        from arborlm.frontend_lang.global_config import global_config

        global_config.default_backend = None
        with pytest.raises(ValueError, match="backend"):
            prog.run()
    finally:
        global_config.default_backend = previous


def test_chat_template_markers_follow_the_tokenizer(tiny_tokenizer):
    template = ChatTemplate.from_tokenizer(tiny_tokenizer)
    rendered = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "S1"}, {"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"}],
        tokenize=False,
    )
    ours = "".join(template.prefix(r) + c + template.suffix(r) for r, c in
                   [("system", "S1"), ("user", "U1"), ("assistant", "A1")])
    assert ours == rendered
    generation = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "S1"}, {"role": "user", "content": "U1"}], tokenize=False,
        add_generation_prompt=True,
    )
    assert generation == ours[: ours.index("A1")]


def test_program_on_engine_reuses_prefix(engine):
    """The later gen calls of a program are served mostly from the radix cache."""
    state = two_turns.run(question="What is a radix tree?", backend=engine, temperature=0, ignore_eos=True)
    first, second = state.get_meta_info("first"), state.get_meta_info("second")
    assert first["completion_tokens"] == 4
    assert second["cached_tokens"] > first["prompt_tokens"] // 2
    assert second["cached_tokens"] < second["prompt_tokens"]
    assert state.text().count("<|im_start|>assistant\n") == 2
    assert state["first"] in state.text()


def test_set_default_backend_accepts_engine(engine):
    previous = sgl.get_default_backend()
    try:
        sgl.set_default_backend(engine)
        state = two_turns.run(question="Hi", temperature=0)
        assert isinstance(state["second"], str)
    finally:
        from arborlm.frontend_lang.global_config import global_config

        global_config.default_backend = previous


def test_bad_sampling_in_gen_is_typed_error_and_engine_keeps_serving(engine):
    @sgl.function
    def bad(s):
        s += "x" + sgl.gen("y", temperature=-1)

    with pytest.raises(InvalidRequestError, match="temperature"):
        bad.run(backend=engine)
    assert two_turns.run(question="still", backend=engine, temperature=0)["first"] is not None


def test_gen_constraints_on_engine(engine):
    """choices (a select, metacharacters kept literally), regex and a pydantic schema on a random model."""
    import json
    import re

    from pydantic import BaseModel

    class Point(BaseModel):
        x: int
        y: bool

    @sgl.function
    def program(s):
        s += "Pick: " + sgl.gen("pick", choices=["a+b", "c.d", "(x)"])
        s += "\nCode: " + sgl.gen("code", regex=r"[A-Z]{3}-\d{2}", temperature=1.0, seed=6)
        s += "\nPoint: " + sgl.gen("point", json_schema=Point, temperature=1.0, seed=7, max_tokens=64)

    state = program.run(backend=engine)
    assert state["pick"] in ("a+b", "c.d", "(x)")
    assert re.fullmatch(r"[A-Z]{3}-\d{2}", state["code"])
    if state.get_meta_info("point")["finish_reason"]["type"] == "stop":
        Point.model_validate(json.loads(state["point"]))
    with pytest.raises(InvalidRequestError):
        sgl.gen("x", choices=[])
    with pytest.raises(InvalidRequestError):
        sgl.gen("x", regex="a", choices=["a"])
