"""SGLang's frontend surface without a model (a port of the shape of SGLang's frontend tests):
every public name, each calling convention, fork groups, copy, run_batch forms, global_config,
token usage, stop_regex and API speculative execution on recording fake backends."""

from __future__ import annotations

import json
import re
import threading

import pytest

import arborlm as sgl
from arborlm.chat_template import ChatTemplate
from arborlm.errors import InvalidRequestError
from arborlm.frontend_lang import ir
from arborlm.frontend_lang.api import JSON_STRING_REGEX
from arborlm.frontend_lang.backend.base_backend import (
    BaseBackend,
    StreamChunk,
    UnsupportedByBackendError,
)
from arborlm.frontend_lang.global_config import global_config
from arborlm.frontend_lang.speculative import SpeculationMismatch

# `__all__` of SGLang's sglang/__init__.py, plus the public functions of sglang/lang/api.py.
SGLANG_EXPORTS = (
    "Engine", "Runtime", "assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen",
    "gen_int", "gen_string", "get_server_info", "image", "select", "set_default_backend", "system",
    "system_begin", "system_end", "user", "user_begin", "user_end", "video", "RuntimeEndpoint",
    "greedy_token_selection", "token_length_normalized", "unconditional_likelihood_normalized", "Anthropic",
    "LiteLLM", "OpenAI", "VertexAI", "global_config", "__version__", "separate_reasoning",
)
REFUSED = ("image", "video", "Anthropic", "LiteLLM", "VertexAI")
TEMPLATE = ChatTemplate({"system": ("<s>", "</s>"), "user": ("<u>", "</u>"), "assistant": ("<a>", "</a>")})
META = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "finish_reason": {"type": "stop"}}


class Fake(BaseBackend):
    """Answers from `answers` in turn (the last one repeats); records every call; streams by character."""

    def __init__(self, *answers: str, chat: bool = False, finish: str = "stop"):
        self.answers = list(answers or ["ok"])
        self.calls: list[dict] = []
        self.uses_chat_messages = chat
        self.finish = finish
        self.closed_streams = 0
        self.lock = threading.Lock()

    def get_chat_template(self) -> ChatTemplate:
        return TEMPLATE

    def _answer(self, text, sampling, options) -> tuple[str, dict]:
        with self.lock:
            self.calls.append({"text": text, "sampling": dict(sampling), "options": dict(options)})
            answer = self.answers[min(len(self.calls) - 1, len(self.answers) - 1)]
        meta = {**META, "prompt_tokens": len(text), "completion_tokens": len(answer),
                "finish_reason": {"type": self.finish}}
        return answer, meta

    def generate(self, text, sampling_params, **options):
        return self._answer(text, sampling_params, options)

    def stream(self, text, sampling_params, **options):
        answer, meta = self._answer(text, sampling_params, options)
        try:
            for i, ch in enumerate(answer):
                yield StreamChunk(ch, {**meta, "completion_tokens": i + 1})
        finally:
            self.closed_streams += 1

    def prefill(self, text):
        with self.lock:
            self.calls.append({"text": text, "prefill": True})
        return {**META, "prompt_tokens": len(text)}


@pytest.fixture
def no_default_backend():
    previous = global_config.default_backend
    global_config.default_backend = None
    yield
    global_config.default_backend = previous


def test_every_sglang_export_exists_and_the_refused_ones_say_why():
    missing = [name for name in SGLANG_EXPORTS if not hasattr(sgl, name)]
    assert missing == []
    assert set(sgl.__all__) >= set(SGLANG_EXPORTS)
    for name in REFUSED:
        with pytest.raises(UnsupportedByBackendError, match="arborlm") as info:
            getattr(sgl, name)("x.png", 4) if name == "video" else getattr(sgl, name)("x")
        assert info.value.param == name.lower() if name in ("image", "video") else info.value.param == name


def test_importing_arborlm_does_not_load_the_dsl():
    import subprocess
    import sys

    code = ("import sys, arborlm, arborlm.entrypoints.http_server; "
            "print(sorted(m for m in sys.modules if m.startswith('arborlm.frontend_lang')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_ir_names_that_map_to_arborlms_classes():
    from arborlm.frontend_lang.function import SglFunction
    from arborlm.frontend_lang.ir import SglArgument, SglVariable
    from arborlm.frontend_lang.tracer import SglArgument as TracerArgument

    assert isinstance(sgl.function(lambda s: None), ir.SglFunction) and ir.SglFunction is SglFunction
    assert SglArgument is SglVariable is TracerArgument
    for cls, param in ((ir.SglImage, "image"), (ir.SglVideo, "video")):
        with pytest.raises(UnsupportedByBackendError) as info:
            cls("x.png")
        assert info.value.param == param
    with pytest.raises(AttributeError):
        ir.SglNoSuchNode  # noqa: B018 - the module's __getattr__ must still refuse unknown names


def test_ir_constants_are_sglangs():
    assert (ir.REGEX_INT, ir.REGEX_FLOAT, ir.REGEX_BOOL, ir.REGEX_STR) == (
        r"[-+]?[0-9]+[ \n]*", r"[-+]?[0-9]*\.?[0-9]+[ \n]*", r"(True|False)", r"\"[\w\d\s]*\"")
    assert re.fullmatch(ir.REGEX_INT, "-42 \n") and re.fullmatch(ir.REGEX_FLOAT, "3.14\n")


def test_dtype_int_and_float_are_json_numbers():
    for dtype, good, bad in ((int, ["0", "-7", "123456789012345678"], ["007", "+1", "1.5", "1234567890123456789"]),
                             (float, ["0.5", "-3", "10.25"], ["01.5", "+2.0", "1.", ".5"])):
        regex = sgl.gen("x", dtype=dtype).sampling["regex"]
        assert all(re.fullmatch(regex, t) and json.loads(t) == dtype(t) for t in good)
        assert not any(re.fullmatch(regex, t) for t in bad)


@pytest.mark.parametrize("text, valid", [('"ab"', True), ('"a\\nb \\u00e9 \\" \\\\"', True), ('"a\tb"', False),
                                         ('"a\nb"', False), ('"a\\qb"', False), ('"\x01"', False), ('"é"', True)])
def test_dtype_str_regex_is_exactly_the_json_strings(text, valid):
    assert bool(re.fullmatch(JSON_STRING_REGEX, text)) is valid
    try:
        json.loads(text)
        parses = True
    except json.JSONDecodeError:
        parses = False
    assert parses is valid
    gen = sgl.gen_string("s")
    assert gen.sampling["regex"] == JSON_STRING_REGEX == sgl.gen("t", dtype=str).sampling["regex"]


@sgl.function
def qa(s, question, suffix="?"):
    s += sgl.user(question + suffix)
    s += sgl.assistant(sgl.gen("answer", max_tokens=4))


def test_calling_a_function_runs_it_and_nested_calls_share_the_state():
    backend = Fake("A")
    state = qa(question="Why", backend=backend, temperature=0)
    assert state["answer"] == "A" and state.text() == "<u>Why?</u><a>A</a>"
    assert backend.calls[0]["sampling"] == {"temperature": 0, "max_new_tokens": 4}
    qa(question="Why", backend=backend, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=None)
    assert backend.calls[-1]["options"] == {"return_logprob": True, "top_logprobs_num": 2}  # request fields
    assert backend.calls[-1]["sampling"] == {"max_new_tokens": 4}
    streamed = qa("How", backend=backend, stream=True)
    assert "".join(streamed.text_iter("answer")) == "A"

    @sgl.function
    def outer(s):
        s += "Start. "
        qa(s, "one")
        qa(s, question="two", suffix="!")

    state = outer(backend=backend)
    assert state.text() == "Start. <u>one?</u><a>A</a><u>two!</u><a>A</a>"
    assert [m["role"] for m in state.messages()] == ["user", "assistant"] * 2
    assert outer.trace().nodes[0].value == "Start. "  # a nested call inside tracing records, not runs


def test_fork_groups_are_assignable_and_join_modes():
    backend = Fake("x")

    @sgl.function
    def tips(s):
        s += "Tips:\n"
        forks = s.fork(3)
        for i in range(3):
            forks[i] += f"Tip {i + 1}:"
            forks[i] += sgl.gen("tip", max_tokens=8, stop=["\n\n"])
        forks.join()
        s += "Summary:" + sgl.gen("summary", max_tokens=4)
        s["tips_copy"] = [forks[i]["tip"] for i in range(3)]
        parts = s.fork(2)
        parts += lambda i: f"[{i}]"
        parts += ["a", "b"]
        parts += sgl.gen("more", max_tokens=2)
        parts.join(mode="concate_and_append")
        with pytest.raises(TypeError, match="cannot be replaced"):
            parts[0] = s
        with pytest.raises(ValueError, match="join mode"):
            s.fork(2).join(mode="append_kv")

    state = tips.run(backend=backend)
    assert state["tip"] == ["x", "x", "x"] and state["tips_copy"] == ["x", "x", "x"]
    assert state.text() == "Tips:\nSummary:x[0]ax[1]bx"
    assert len(state.get_meta_info("tip")) == 3


def test_copy_is_a_fork_of_one_joined_at_the_end_of_the_block():
    @sgl.function
    def prog(s):
        s += "Q: 1+1?\nA:"
        with s.copy() as c:
            c += sgl.gen("draft", max_tokens=2)
        s += sgl.gen("final", max_tokens=2)

    state = prog.run(backend=Fake("2", "3"))
    assert state["draft"] == ["2"] and state["final"] == "3"
    assert state.text() == "Q: 1+1?\nA:3"  # the copy's text stays out of the parent


def test_run_batch_takes_dicts_or_positional_tuples():
    backend = Fake("A")
    states = qa.run_batch([("one",), ("two", "!"), {"question": "three"}], backend=backend)
    assert [s.text() for s in states] == ["<u>one?</u><a>A</a>", "<u>two!</u><a>A</a>", "<u>three?</u><a>A</a>"]
    for bad in ([()], [("a", "b", "c")], ["one"]):
        with pytest.raises(TypeError, match="run_batch item 0"):
            qa.run_batch(bad, backend=backend)
    assert qa.bind(suffix="...").run_batch([("four",)], backend=backend)[0].text().startswith("<u>four...</u>")


def test_global_config_default_backend_verbosity_and_precache(no_default_backend, capsys):
    assert sgl.flush_cache() is False and sgl.get_server_info() is None  # SGLang's answers without a backend
    backend = Fake("A")
    sgl.set_default_backend(backend)
    assert sgl.global_config.default_backend is backend
    global_config.verbosity = 2
    try:
        qa.run(question="Hi")
    finally:
        global_config.verbosity = 0
    assert capsys.readouterr().out == "<u>Hi?</u><a>A</a>\n"

    @sgl.function
    def shared(s, q):
        s += "A long shared instruction. " + q + sgl.gen("a", max_tokens=1)

    shared.run_batch([{"q": "x"}, {"q": "y"}])
    assert sum(1 for c in backend.calls if c.get("prefill")) == 1
    global_config.enable_precache_with_tracing = False
    try:
        shared.run_batch([{"q": "x"}, {"q": "y"}])
    finally:
        global_config.enable_precache_with_tracing = True
    assert sum(1 for c in backend.calls if c.get("prefill")) == 1
    global_config.skip_special_tokens_in_output = False
    try:
        qa.run(question="Hi")
    finally:
        global_config.skip_special_tokens_in_output = True
    assert backend.calls[-1]["sampling"]["skip_special_tokens"] is False


def test_token_usage_counts_every_request():
    backend = Fake("abc")
    backend.token_usage.reset()

    @sgl.function
    def prog(s):
        s += "Hello" + sgl.gen("a", max_tokens=3)
        forks = s.fork(2)
        forks += sgl.gen("b", max_tokens=3)
        forks.join()

    prog.run(backend=backend)
    texts = [c["text"] for c in backend.calls]
    assert texts == ["Hello", "Helloabc", "Helloabc", "Helloabc"]  # gen, the fork's prefill, two branches
    assert backend.token_usage.prompt_tokens == sum(len(t) for t in texts)
    assert backend.token_usage.completion_tokens == 3 * 3
    backend.token_usage.reset()
    assert (backend.token_usage.prompt_tokens, backend.token_usage.completion_tokens) == (0, 0)


def test_stop_regex_cuts_the_generation_at_the_first_match_and_closes_the_stream():
    backend = Fake("The year 1969 and 2001.")

    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("a", max_tokens=32, stop_regex=r"[0-9]{4}") + "|"
        s += sgl.gen("b", max_tokens=32, stop_regex=["and", r"\.$"], return_text_in_logprobs=True,
                     return_logprob=True)

    state = prog.run(backend=backend)
    assert state["a"] == "The year 1969" and state["b"] == "The year 1969 and"
    assert state.text() == "Q:The year 1969|The year 1969 and"
    assert state.get_meta_info("a")["finish_reason"] == {"type": "stop", "matched": "[0-9]{4}"}
    assert state.get_meta_info("a")["completion_tokens"] == len("The year 1969")
    assert backend.closed_streams == 2
    assert backend.calls[1]["options"] == {"return_logprob": True, "return_text_in_logprobs": True}
    assert sgl.gen("c", stop_regex="x").stop_regex == ["x"]
    for bad in ("(", ["ok", "[a-"], [], 3):
        with pytest.raises(InvalidRequestError) as info:
            sgl.gen("c", stop_regex=bad)
        assert info.value.param == "stop_regex"


CHARACTER = "Steve\nBirthday: 1955\nJob: CEO\n"


def character(spec: int | None):
    @sgl.function(num_api_spec_tokens=spec)
    def gen_character(s):
        s += "Name:" + sgl.gen("name", stop="\n") + "\nBirthday:" + sgl.gen("birthday", stop="\n")
        s += "\nJob:" + sgl.gen("job", stop="\n") + "\n"

    return gen_character


def test_completion_speculation_serves_the_gens_from_one_request():
    spec = Fake(" Ada\nBirthday: 1815\nJob: analyst\n")
    state = character(64).run(backend=spec, temperature=0)
    assert (state["name"], state["birthday"], state["job"]) == (" Ada", " 1815", " analyst")
    assert len(spec.calls) == 1 and "stop" not in spec.calls[0]["sampling"]
    assert spec.calls[0]["sampling"]["max_new_tokens"] == 64
    assert state.get_meta_info("birthday")["speculated"] is True
    plain = Fake(" Ada", " 1815", " analyst")
    state = character(None).run(backend=plain, temperature=0)
    assert len(plain.calls) == 3 and spec.token_usage.prompt_tokens < plain.token_usage.prompt_tokens
    # Text the model did not speculate drops the speculation: the next gen makes its own request.
    diverging = Fake(" Ada\nBorn: 1815\n", " 1815\nJob: analyst\n")
    state = character(64).run(backend=diverging)
    assert (state["name"], state["birthday"], state["job"]) == (" Ada", " 1815", " analyst")
    assert len(diverging.calls) == 2 and diverging.calls[1]["text"].endswith("Birthday:")
    # A speculation cut by the length limit before the stop cannot tell where the gen ends.
    short = Fake(" Ada Lovelace", " Ada", finish="length")
    assert character(8).run(backend=short)["name"] == " Ada"


def test_chat_speculation_generates_the_assistant_turn_once():
    @sgl.function(num_api_spec_tokens=128)
    def card(s):
        s += sgl.user("Make a character.")
        s += sgl.assistant("Name:" + sgl.gen("name", stop="\n") + "\nJob:" + sgl.gen("job", stop="\n"))

    backend = Fake("Name: Ada\nJob: analyst", chat=True)
    state = card.run(backend=backend)
    assert (state["name"], state["job"]) == (" Ada", " analyst")
    assert len(backend.calls) == 1
    assert backend.calls[0]["options"]["messages"] == [{"role": "user", "content": "Make a character."}]
    assert state.messages()[-1] == {"role": "assistant", "content": "Name: Ada\nJob: analyst"}
    wrong = Fake("Title: Ada", chat=True)
    with pytest.raises(SpeculationMismatch, match="3 tries"):
        card.run(backend=wrong)
    assert len(wrong.calls) == 3
    # Without speculation such a turn is refused: a chat API cannot continue written assistant text.
    with pytest.raises(UnsupportedByBackendError):
        sgl.function(card.func).run(backend=Fake("x", chat=True))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_api_spec_tokens"):
            sgl.function(num_api_spec_tokens=bad)(card.func)


def test_openai_backend_arguments():
    import openai

    azure = sgl.OpenAI("gpt-4o", is_azure=True, api_key="k", azure_endpoint="https://example.openai.azure.com",
                       api_version="2024-06-01")
    assert isinstance(azure.client, openai.AzureOpenAI)
    assert sgl.OpenAI("m", is_chat_model=False, base_url="http://127.0.0.1:9/v1").uses_chat_messages is False
    chat_only = sgl.OpenAI("m", True, base_url="http://127.0.0.1:9/v1")

    @sgl.function
    def plain(s):
        s += "Once" + sgl.gen("x", max_tokens=2)

    with pytest.raises(UnsupportedByBackendError, match="assistant") as info:  # refused before any request
        plain.run(backend=chat_only)
    assert info.value.param == "messages"
    with pytest.raises(TypeError, match="is_chat_model"):
        sgl.OpenAI("m", is_chat_model="yes")
