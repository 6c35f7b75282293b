"""SGLang's frontend test programs (the shape of sglang/test/test_programs.py) on the tiny model's
Engine: structure and validity, never what a random model knows."""

from __future__ import annotations

import asyncio
import json
import re

import arborlm as sgl
from arborlm.frontend_lang.api import JSON_STRING_REGEX

# Token ids of SmolLM2's tokenizer: '"', a raw tab, a raw \x01. A bias toward the control
# characters tempts every string gen to write them raw, which JSON forbids; the quote's smaller
# bias closes the string as soon as the grammar refuses them.
QUOTE, TAB, CTRL_A = 18, 197, 191
TEMPT_CONTROL_CHARS = {str(TAB): 100.0, str(CTRL_A): 90.0, str(QUOTE): 40.0}


@sgl.function
def decode_json(s):
    s += "Generate a JSON object to describe the basic city information of Paris.\n"
    with s.var_scope("json_output"):
        s += "{\n"
        s += '  "name": ' + sgl.gen_string() + ",\n"
        s += '  "population": ' + sgl.gen_int() + ",\n"
        s += '  "area": ' + sgl.gen(dtype=int) + ",\n"
        s += '  "country": ' + sgl.gen_string() + ",\n"
        s += '  "timezone": ' + sgl.gen(dtype=str) + "\n"
        s += "}"


def test_decode_json_from_typed_gens_is_valid_json(engine):
    state = decode_json.run(backend=engine, max_new_tokens=24, temperature=1.0, seed=11, logit_bias=TEMPT_CONTROL_CHARS)
    obj = json.loads(state["json_output"])
    assert isinstance(obj["name"], str) and isinstance(obj["timezone"], str)
    assert isinstance(obj["population"], int) and isinstance(obj["area"], int)
    strings = re.findall(r': ("(?:[^"\\]|\\.)*")', state["json_output"])
    assert len(strings) == 3 and all(re.fullmatch(JSON_STRING_REGEX, t) for t in strings)


def test_decode_json_cut_by_length_still_parses(engine):
    """Each typed gen gets 5 tokens, too few for most strings: the interpreter closes them
    (`literals.complete_literal`), and the ints stop at the first non-digit the model writes."""
    state = decode_json.run(backend=engine, max_new_tokens=5, temperature=1.0, seed=3)
    obj = json.loads(state["json_output"])
    assert isinstance(obj["name"], str) and isinstance(obj["population"], int)
    assert state.text().endswith(state["json_output"])


def test_dtype_gens_and_the_ir_regexes(engine):
    @sgl.function
    def dtype_gen(s):
        from arborlm.frontend_lang.ir import REGEX_BOOL, REGEX_STR

        s += "Q: Is the sky blue?\nA: " + sgl.gen("bool_res", dtype=bool) + "\n"
        s += "Q: Which year?\nA: " + sgl.gen("int_res", dtype="int", max_tokens=20) + "\n"
        s += "Q: Pi?\nA: " + sgl.gen("float_res", dtype=float, max_tokens=40) + "\n"
        s += "Q: Yes?\nA: " + sgl.gen("yes", regex=REGEX_BOOL) + "\n"
        s += "Q: Name?\nA: " + sgl.gen("name", regex=REGEX_STR, max_tokens=6)

    state = dtype_gen.run(backend=engine, temperature=1.0, seed=7, logit_bias={str(QUOTE): 40.0})
    assert state["bool_res"] in ("True", "False") and state["yes"] in ("True", "False")
    int(state["int_res"])
    float(state["float_res"])
    assert re.fullmatch(r'"[\w\d\s]*"', state["name"])


def test_tool_use_called_as_a_function(engine):
    @sgl.function
    def tool_use(s, lhs, rhs):
        s += "Question: What is the product of " + str(lhs) + " and " + str(rhs) + "?\n"
        s += "Answer: The answer is calculate(" + sgl.gen("expression", max_tokens=6, stop=")") + ") = "
        with s.var_scope("answer"):
            s += str(len(s["expression"]))

    state = tool_use(lhs=257, rhs=983, temperature=0, backend=engine)
    assert ")" not in state["expression"]
    assert state["answer"] == str(len(state["expression"]))
    assert state.text() == tool_use.run(lhs=257, rhs=983, temperature=0, backend=engine).text()


def test_parallel_decoding_and_encoding(engine):
    @sgl.function
    def parallel(s, contexts):
        s += "Tips:\n"
        forks = s.fork(3)
        for i in range(3):
            forks[i] += f"Tip {i + 1}:"
            forks[i] += sgl.gen("detailed_tip", 6, stop=["\n\n"])
        forks.join()
        for i in range(3):
            s += f"Tip {i + 1}:" + forks[i]["detailed_tip"] + "\n"
        memo = s.fork(len(contexts))
        memo += lambda i: f"Statement {i}: " + contexts[i] + "\n"
        memo.join(mode="concate_and_append")
        s += "ASSISTANT:" + sgl.gen("answer", max_tokens=4)

    contexts = ["Ethan is the father of Liam.", "Noah is the father of Julian."]
    state = parallel.run(contexts=contexts, backend=engine, temperature=0)
    assert len(state["detailed_tip"]) == 3
    statements = "".join(f"Statement {i}: {c}\n" for i, c in enumerate(contexts))
    assert statements + "ASSISTANT:" + state["answer"] in state.text()


def test_stop_regex_stops_where_the_pattern_first_matches(engine):
    @sgl.function
    def story(s, stop_regex=None):
        s += "Once upon a time" + sgl.gen("story", max_tokens=24, ignore_eos=True, stop_regex=stop_regex)

    reference = story.run(backend=engine, temperature=0)["story"]
    pattern = re.escape(reference[8:11])
    end = re.search(pattern, reference).end()
    state = story.run(stop_regex=[pattern, "never-there"], backend=engine, temperature=0)
    assert state["story"] == reference[:end]
    meta = state.get_meta_info("story")
    assert meta["finish_reason"] == {"type": "stop", "matched": pattern}
    assert meta["completion_tokens"] < 24  # the request was aborted there, not run to its end
    streamed = story.run(stop_regex=pattern, backend=engine, temperature=0, stream=True)
    assert "".join(streamed.text_iter("story")) == reference[:end]


def test_async_stream_meta_data_and_logprob_text(engine):
    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=10, ignore_eos=True, return_logprob=True,
                                   return_text_in_logprobs=True))

    async def collect():
        state = qa(question="Hi", backend=engine, stream=True, temperature=0)
        return [item async for item in state.text_async_iter("answer", return_meta_data=True)], state

    items, state = asyncio.run(collect())
    assert "".join(piece for piece, _ in items) == state["answer"]
    for _, meta in items:
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    final = state.get_meta_info("answer")
    assert final["completion_tokens"] == 10
    tokens = [tid for _, tid, _ in final["output_token_logprobs"]]
    assert [text for _, _, text in final["output_token_logprobs"]] == [engine.tokenizer.decode([t]) for t in tokens]


def test_token_usage_matches_the_server_counters(engine):
    @sgl.function
    def prog(s):
        s += sgl.user("Pick a colour.")
        s += sgl.assistant(sgl.select("colour", ["red", "green"]) + ". " + sgl.gen("why", max_tokens=5))
        forks = s.fork(2)
        forks += sgl.gen("more", max_tokens=3)
        forks.join()

    from arborlm.frontend_lang.api import as_backend

    backend = as_backend(engine)
    backend.token_usage.reset()
    before = engine.get_server_info()
    state = prog.run(backend=engine, temperature=0)
    after = engine.get_server_info()
    # Every request the program made (select's prefill and scoring, the gens, the fork's prefill) is counted.
    assert backend.token_usage.prompt_tokens == after["num_prompt_tokens"] - before["num_prompt_tokens"]
    metas = [state.get_meta_info("colour"), state.get_meta_info("why"), *state.get_meta_info("more")]
    assert backend.token_usage.completion_tokens == sum(m["completion_tokens"] for m in metas)


def test_api_speculative_execution_on_the_engine(engine):
    @sgl.function(num_api_spec_tokens=32)
    def character(s):
        s += "Name: Steve Jobs.\nBirthday: February 24, 1955.\nJob: Apple CEO.\n\n"
        s += "Name:" + sgl.gen("name", stop="\n", max_tokens=8) + "\nBirthday:" + sgl.gen("birthday", stop="\n")
        s += "\nJob:" + sgl.gen("job", stop="\n") + "\n"

    state = character.run(backend=engine, temperature=0)
    for name in ("name", "birthday", "job"):
        assert isinstance(state[name], str) and "\n" not in state[name]
    assert state.text().endswith("\nJob:" + state["job"] + "\n")
