"""Grammar-constrained requests inside the scheduler, on the tiny random Llama.

A random model is the harshest user of a grammar: it would emit anything, so
every valid output here is the mask's doing.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from arborlm.constrained.base import CompiledGrammar, GrammarBackend, GrammarError, GrammarKey
from arborlm.constrained.grammar_manager import GrammarManager
from arborlm.constrained.grammar_spec import grammar_spec_from_params
from arborlm.errors import InvalidRequestError
from arborlm.runtime.io_struct import TokenizedGenerateReqInput, finish_reason_to_matched_stop
from arborlm.sampling_params import SamplingParams
from tests.runtime.scheduler_helpers import (
    assert_idle_pools,
    create_scheduler,
    make_req,
    run_to_completion,
)

PROMPT = [1, 504, 3458, 314, 253, 1789, 28, 2]  # any ids: the model is random


def constrained_req(rid: str, seed: int = 0, backend: str = "xgrammar", prompt=PROMPT, **sampling):
    sampling.setdefault("temperature", 1.0)
    params = SamplingParams(**sampling)
    params.verify(49152)
    params = params.normalized()
    return TokenizedGenerateReqInput(
        rid=rid, input_ids=list(prompt), sampling_params=params, seed=seed,
        grammar=grammar_spec_from_params(params, backend),
    )


@pytest.fixture(scope="module")
def sched(tiny_llama_dir, tiny_tokenizer):
    return create_scheduler(tiny_llama_dir, tiny_tokenizer, max_total_tokens=8192, disable_jump_forward=False)


def texts(sched, result):
    return {rid: sched.tokenizer.decode(ids, skip_special_tokens=True) for rid, ids in result.tokens.items()}


REGEXES = {
    "date": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "email": r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "alternation": r"(yes|no|maybe)",
    "unicode": r"[α-ω]{2,5} [一-龥]{1,3}",
}


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_regex_outputs_full_match(sched, name):
    pattern = REGEXES[name]
    reqs = [constrained_req(f"{name}{s}", seed=s, regex=pattern, max_new_tokens=64) for s in range(3)]
    result = run_to_completion(sched, reqs)
    for rid, text in texts(sched, result).items():
        assert result.finish[rid]["type"] == "stop", (rid, result.finish[rid], text)
        assert re.fullmatch(pattern, text), (rid, text)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "grace", "linus"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "admin", "tags"],
}


def test_json_schema_outputs_validate_and_jump_forward_saves_steps(sched):
    before = dict(sched.stats)
    reqs = [constrained_req(f"j{s}", seed=s, json_schema=SCHEMA, max_new_tokens=128) for s in range(4)]
    result = run_to_completion(sched, reqs)
    for rid, text in texts(sched, result).items():
        assert result.finish[rid]["type"] == "stop", (rid, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    # Keys and punctuation are forced: appended without decode steps.
    assert sched.stats["num_jump_forward_tokens"] > before["num_jump_forward_tokens"]
    assert sched.stats["num_jump_forward_steps"] > before["num_jump_forward_steps"]


def test_new_prompt_joins_a_jump_forward_step(tiny_llama_dir, tiny_tokenizer):
    """A prompt arriving while another request jumps forward is prefilled in that very
    step (its first token one step after it arrives), and both outputs stay right."""
    s = create_scheduler(tiny_llama_dir, tiny_tokenizer, max_total_tokens=8192, disable_jump_forward=False)
    tokens: dict[str, list[int]] = {"j": [], "new": []}
    finish = {}

    def step():
        outs = s.step()
        for out in outs:
            tokens[out.rid] += out.new_token_ids
            if out.finish_reason is not None:
                finish[out.rid] = out.finish_reason
        return outs

    s.add_request(constrained_req("j", seed=1, json_schema=SCHEMA, max_new_tokens=128))
    # By condition, not by step count: the grammar compiles on a slot thread (under the
    # default backend, auto, after building its first backend), and steps go on meanwhile.
    deadline = time.monotonic() + 60
    while not s.jump_forward_reqs and time.monotonic() < deadline and "j" not in finish:
        step()
        time.sleep(0.005)
    assert s.jump_forward_reqs, "the schema forces tokens after the first one"
    s.add_request(make_req("new", [5, 77, 901, 3], max_new_tokens=6, ignore_eos=True))
    jumps = s.stats["num_jump_forward_steps"]
    outs = step()
    assert s.stats["num_jump_forward_steps"] == jumps + 1
    assert [len(o.new_token_ids) > 0 for o in outs if o.rid == "new"] == [True]
    for _ in range(500):
        if not s.has_work():
            break
        step()
    assert finish["new"] == {"type": "length", "length": 6} and len(tokens["new"]) == 6
    assert finish["j"]["type"] == "stop"
    jsonschema.validate(json.loads(s.tokenizer.decode(tokens["j"], skip_special_tokens=True)), SCHEMA)
    assert_idle_pools(s)


def test_jump_forward_off_gives_valid_output_with_more_decode_steps(tiny_llama_dir, tiny_tokenizer):
    steps = {}
    for off in (False, True):
        s = create_scheduler(tiny_llama_dir, tiny_tokenizer, max_total_tokens=4096, disable_jump_forward=off)
        result = run_to_completion(s, [constrained_req("j", seed=3, json_schema=SCHEMA, max_new_tokens=128)])
        text = texts(s, result)["j"]
        jsonschema.validate(json.loads(text), SCHEMA)
        steps[off] = s.stats["num_decode_steps"]
        assert (s.stats["num_jump_forward_tokens"] == 0) == off
    assert steps[False] < steps[True]


def test_length_finish_leaves_a_valid_prefix(sched):
    spec_params = dict(json_schema=SCHEMA, max_new_tokens=7)
    result = run_to_completion(sched, [constrained_req("short", seed=1, **spec_params)])
    assert result.finish["short"]["type"] == "length"
    matcher = sched.grammar_manager.request(grammar_spec_from_params(SamplingParams(json_schema=SCHEMA), "xgrammar").key)
    compiled = matcher.result()
    fresh = compiled.new_matcher()
    assert all(fresh.accept_token(t) for t in result.tokens["short"])


def test_retracted_constrained_request_resumes_with_same_output(tiny_llama_dir, tiny_tokenizer):
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 8, "maxItems": 8}
    prompts = [[1, 20 + i, 30 + i, 40 + i] * 5 for i in range(4)]

    def run(**kw):
        s = create_scheduler(tiny_llama_dir, tiny_tokenizer, **kw)
        reqs = [constrained_req(f"r{i}", prompt=p, json_schema=schema, temperature=0, max_new_tokens=48)
                for i, p in enumerate(prompts)]
        return s, run_to_completion(s, reqs)

    _, reference = run(max_total_tokens=4096)
    tight, result = run(max_total_tokens=140, init_new_token_ratio=0.05, min_new_token_ratio=0.0,
                        new_token_ratio_decay=0.0)
    assert tight.stats["num_retractions"] > 0
    for rid, tokens in reference.tokens.items():
        assert result.tokens[rid] == tokens, f"{rid} changed after retraction"
        jsonschema.validate(json.loads(tight.tokenizer.decode(tokens, skip_special_tokens=True)), schema)


def test_abort_of_constrained_request_drops_its_matcher(sched):
    sched.add_request(constrained_req("a", json_schema=SCHEMA, max_new_tokens=100))
    while not sched.running and not sched.jump_forward_reqs:
        sched.step()
    req = (sched.running + sched.jump_forward_reqs)[0]
    assert req.grammar is not None
    sched.abort_request("a")
    finish = None
    while sched.has_work():
        for out in sched.step():
            finish = out.finish_reason or finish
    assert finish["type"] == "abort"
    assert req.grammar is None
    assert_idle_pools(sched)


def test_abort_while_grammar_compiles(tiny_llama_dir, tiny_tokenizer):
    s = create_scheduler(tiny_llama_dir, tiny_tokenizer)
    s._grammar_manager = GrammarManager(SlowBackend(delay=1.0), compile_timeout=30)
    s.add_request(constrained_req("c", regex="a"))
    assert s.grammar_queue
    s.abort_request("c")
    outs = s.step()
    assert [o.finish_reason["type"] for o in outs] == ["abort"]
    assert not s.has_work()
    s._grammar_manager.shutdown()


class SlowCompiled(CompiledGrammar):
    def __init__(self, inner):
        self.inner = inner

    def new_matcher(self, stop_token_ids=()):
        return self.inner.new_matcher(stop_token_ids)


class SlowBackend(GrammarBackend):
    """Compiles `regex` keys through xgrammar, but the one named "slow" takes `delay` seconds."""

    name = "slow"
    kinds = ("regex",)
    inner = None

    def __init__(self, delay: float):
        self.delay = delay

    @classmethod
    def _check_syntax(cls, key):
        pass

    def compile(self, key: GrammarKey):
        if key.text == "slow":
            time.sleep(self.delay)
        return SlowCompiled(self.inner.compile(key))


def test_compile_timeout_fails_that_request_only(tiny_llama_dir, tiny_tokenizer):
    s = create_scheduler(tiny_llama_dir, tiny_tokenizer)
    backend = SlowBackend(delay=3.0)
    backend.inner = s.grammar_manager.backend
    s._grammar_manager = GrammarManager(backend, compile_timeout=0.5)
    reqs = [
        constrained_req("slow", regex="a", max_new_tokens=8),
        make_req("free", PROMPT, max_new_tokens=8, ignore_eos=True),
        constrained_req("fast", regex="(ab){2,3}", max_new_tokens=16),
    ]
    reqs[0].grammar = grammar_spec_from_params(SamplingParams(regex="slow"), "xgrammar")
    result = run_to_completion(s, reqs)
    assert result.finish["slow"]["type"] == "abort"
    assert "grammar_compile_timeout" in result.finish["slow"]["message"]
    assert result.finish["slow"]["param"] == "regex"
    assert len(result.tokens["free"]) == 8
    assert re.fullmatch("(ab){2,3}", s.tokenizer.decode(result.tokens["fast"], skip_special_tokens=True))
    s._grammar_manager.shutdown()


@pytest.mark.parametrize(
    "sampling, param",
    [
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": {"type": "object", "properties": {"a": {"type": 5}}}}, "json_schema"),
        ({"regex": "(unclosed"}, "regex"),
        ({"ebnf": "root ::= ("}, "ebnf"),
        ({"regex": "a", "ebnf": "root ::= \"a\""}, "ebnf"),
    ],
)
def test_bad_grammars_are_refused_before_queueing(sampling, param):
    params = SamplingParams(**sampling)
    with pytest.raises(InvalidRequestError) as err:
        params.verify(49152)
        grammar_spec_from_params(params, "xgrammar")
    assert err.value.param == param


def test_outlines_refuses_ebnf():
    with pytest.raises(GrammarError, match="outlines"):
        grammar_spec_from_params(SamplingParams(ebnf='root ::= "a"'), "outlines")


def test_grammar_end_is_the_eos_token_on_both_backends(tiny_llama_dir, tiny_tokenizer):
    """outlines ended a request on the last content token ("s" of "yes"), xgrammar on the EOS it
    then forces: both now end on the EOS, so `matched_stop` is the EOS id on either backend."""
    outputs = {}
    for backend in ("xgrammar", "outlines", "llguidance"):
        s = create_scheduler(tiny_llama_dir, tiny_tokenizer, grammar_backend=backend)
        eos = set(s.model_info.eos_token_ids)
        reqs = [constrained_req(f"r{i}", seed=i, backend=backend, regex="(yes|no)", max_new_tokens=8) for i in range(4)]
        result = run_to_completion(s, reqs)
        for rid, tokens in result.tokens.items():
            assert tokens[-1] in eos, (backend, rid, tokens)
            assert result.finish[rid] == {"type": "stop", "matched": tokens[-1]}, (backend, rid)
            assert finish_reason_to_matched_stop(result.finish[rid]) == tokens[-1]
        outputs[backend] = {rid: (texts(s, result)[rid], result.finish[rid]) for rid in result.tokens}
        s.grammar_manager.shutdown()
    assert outputs["xgrammar"] == outputs["outlines"] == outputs["llguidance"]


@pytest.mark.parametrize("backend", ["xgrammar", "outlines", "llguidance"])
def test_grammar_termination_wins_over_min_new_tokens_and_ignore_eos(tiny_llama_dir, tiny_tokenizer, backend):
    """Under a grammar, `min_new_tokens` and `ignore_eos` do not extend the output past the
    grammar's end (SGLang's behaviour): the grammar allows nothing but EOS there."""
    s = create_scheduler(tiny_llama_dir, tiny_tokenizer, grammar_backend=backend)
    eos = set(s.model_info.eos_token_ids)
    reqs = [
        constrained_req("min", backend=backend, regex="(yes|no)", max_new_tokens=32, min_new_tokens=20),
        constrained_req("ignore", seed=1, backend=backend, regex="(yes|no)", max_new_tokens=32, ignore_eos=True),
    ]
    result = run_to_completion(s, reqs)
    for rid, tokens in result.tokens.items():
        assert len(tokens) < 20 and tokens[-1] in eos, (rid, tokens)
        assert result.finish[rid] == {"type": "stop", "matched": tokens[-1]}
        assert texts(s, result)[rid] in ("yes", "no")
    s.grammar_manager.shutdown()


def test_llguidance_json_and_ebnf_outputs_validate_and_jump_forward(tiny_llama_dir, tiny_tokenizer):
    s = create_scheduler(tiny_llama_dir, tiny_tokenizer, grammar_backend="llguidance", disable_jump_forward=False)
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "code": {"type": "integer", "multipleOf": 5}},
              "dependentRequired": {"admin": ["tags"]}}
    reqs = [constrained_req(f"j{i}", seed=i, backend="llguidance", json_schema=schema, max_new_tokens=128)
            for i in range(3)]
    reqs += [constrained_req(f"e{i}", seed=i, backend="llguidance", ebnf='start: "id-" /[0-9]{3}/', max_new_tokens=16)
             for i in range(2)]
    result = run_to_completion(s, reqs)
    for rid, text in texts(s, result).items():
        assert result.finish[rid]["type"] == "stop", (rid, result.finish[rid], text)
        if rid.startswith("j"):
            jsonschema.validate(json.loads(text), schema)
        else:
            assert re.fullmatch(r"id-[0-9]{3}", text), text
    assert s.stats["num_jump_forward_tokens"] > 0
    assert_idle_pools(s)
    s.grammar_manager.shutdown()
