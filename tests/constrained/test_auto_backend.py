"""``grammar_backend="auto"``: the front picks the backend per constraint, the scheduler compiles on it.

A schema only llguidance takes (decimal ``multipleOf``) and one only xgrammar takes
(``propertyNames`` through a ``$ref``) are both accepted, each on its own backend, and a
batch that mixes them on the tiny random Llama ends every request with output that
validates against its schema; the matchers of the two backends fill their rows of one
bitmask, accept, roll back and jump forward side by side.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from arborlm.constrained.auto_backend import AutoGrammarBackend
from arborlm.constrained.base import GrammarError, GrammarKey
from arborlm.constrained.grammar_manager import GrammarManager
from arborlm.constrained.grammar_spec import grammar_spec_from_params
from arborlm.constrained.llguidance_backend import LLGuidanceMatcher
from arborlm.constrained.registry import GRAMMAR_BACKEND_NAMES, resolved_backend
from arborlm.constrained.xgrammar_backend import XGrammarMatcher
from arborlm.runtime.config import GrammarConfig
from arborlm.sampling_params import SamplingParams
from tests.constrained.test_backend_agreement import VOCAB_SIZE
from tests.constrained.test_constrained_scheduler import constrained_req, texts
from tests.runtime.scheduler_helpers import assert_idle_pools, create_scheduler, run_to_completion

INT = {"type": "integer"}
# llguidance enforces a decimal multipleOf; xgrammar's lowering refuses it.
ONLY_LLGUIDANCE = {"type": "object", "properties": {"price": {"type": "number", "multipleOf": 0.25,
                                                               "minimum": 0, "maximum": 10}},
                   "required": ["price"]}
# A propertyNames that is a $ref: xgrammar's lowering resolves it, llguidance does not implement it.
ONLY_XGRAMMAR = {"$defs": {"name": {"pattern": "^[a-c]$"}}, "type": "object",
                 "propertyNames": {"$ref": "#/$defs/name"}, "additionalProperties": INT, "minProperties": 1,
                 "maxProperties": 1}  # one key: a random model cannot repeat it
EVERYWHERE = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def spec_of(schema, backend: str = "auto", lenient: bool = False):
    params = SamplingParams(json_schema=json.dumps(schema), json_schema_lenient=lenient)
    return grammar_spec_from_params(params, backend)


def test_auto_is_a_grammar_backend_choice():
    assert "auto" in GRAMMAR_BACKEND_NAMES
    assert GrammarConfig(grammar_backend="auto").grammar_backend == "auto"
    assert GrammarConfig().grammar_backend == "auto"  # the default (docs/structured_output.md says why)


@pytest.mark.parametrize(("schema", "backend"), [
    (ONLY_LLGUIDANCE, "llguidance"), (ONLY_XGRAMMAR, "xgrammar"), (EVERYWHERE, "xgrammar"),
], ids=["only llguidance", "only xgrammar", "both: the first"])
def test_each_schema_goes_to_the_first_backend_that_accepts_it(schema, backend):
    for other in ("xgrammar", "llguidance"):
        if other != backend and schema is not EVERYWHERE:
            with pytest.raises(GrammarError):
                spec_of(schema, other)
    spec = spec_of(schema)
    assert spec.key.backend == backend
    # The key is the chosen backend's own: what the scheduler compiles is what that backend checked.
    assert spec.key.text == spec_of(schema, backend).key.text


@pytest.mark.parametrize(("params", "backend"), [
    ({"regex": r"\d{3}"}, "xgrammar"),
    ({"ebnf": 'root ::= "a" | "b"'}, "xgrammar"),      # GBNF: xgrammar's
    ({"ebnf": 'start: "a" | "b"'}, "llguidance"),      # Lark: llguidance's only
    ({"json_schema": "$$ANY$$"}, "xgrammar"),
])
def test_other_kinds_are_chosen_the_same_way(params, backend):
    assert grammar_spec_from_params(SamplingParams(**params), "auto").key.backend == backend


def test_refused_everywhere_names_each_backends_reason():
    schema = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    with pytest.raises(GrammarError, match="uniqueItems") as info:
        spec_of(schema)
    assert "llguidance backend refuses it too" in info.value.message and info.value.param == "json_schema"
    with pytest.raises(GrammarError) as info:
        grammar_spec_from_params(SamplingParams(json_schema="{not json"), "auto")
    assert info.value.param == "json_schema"
    assert grammar_spec_from_params(SamplingParams(), "auto") is None


def test_lenient_goes_where_the_fewest_keywords_are_dropped():
    decimal = {"type": "number", "multipleOf": 0.5}
    spec = spec_of(decimal, lenient=True)  # xgrammar would drop multipleOf, llguidance enforces it
    assert (spec.key.backend, spec.dropped) == ("llguidance", ())
    spec = spec_of(EVERYWHERE, lenient=True)
    assert (spec.key.backend, spec.dropped) == ("xgrammar", ())
    strings = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}  # dropped on both
    spec = spec_of(strings, lenient=True)
    assert spec.key.backend == "xgrammar" and spec.dropped == ("uniqueItems at /",)


def test_resolved_backend_names_what_compiles_a_key():
    assert resolved_backend("llguidance", "auto") == "llguidance"
    assert resolved_backend("", "auto") == "xgrammar"  # a key without a choice: a tool call's, after reasoning
    assert resolved_backend("", "outlines") == "outlines"


def test_a_key_naming_another_backend_is_a_grammar_error():
    with pytest.raises(GrammarError, match="auto compiles on"):
        AutoGrammarBackend.check(GrammarKey("regex", "a", backend="outlines"))
    with pytest.raises(ValueError, match="EOS"):
        AutoGrammarBackend(None, VOCAB_SIZE, [])


def test_the_manager_caches_the_same_text_apart_per_backend(tokenizer, eos):
    backend = AutoGrammarBackend(tokenizer, VOCAB_SIZE, [eos])
    assert set(backend._backends) == {"xgrammar"}  # the first choice is built with it, llguidance on first use
    backend.compile(GrammarKey("regex", "a+"))  # no backend named: xgrammar
    assert set(backend._backends) == {"xgrammar"}
    manager = GrammarManager(backend, compile_timeout=60, max_workers=1)
    try:
        waits = [manager.request(GrammarKey("regex", "(yes|no)", backend=name)) for name in ("xgrammar", "llguidance")]
        manager.wait_any(waits, 60)
        compiled = [w._future.result(timeout=60) for w in waits]
        assert isinstance(compiled[0].new_matcher(), XGrammarMatcher)
        assert isinstance(compiled[1].new_matcher(), LLGuidanceMatcher)
        assert manager.stats()["num_compiled"] == 2
    finally:
        manager.shutdown()


def test_a_batch_mixing_both_backends_validates_every_output(tiny_llama_dir, tiny_tokenizer):
    s = create_scheduler(tiny_llama_dir, tiny_tokenizer, grammar_backend="auto", disable_jump_forward=False)
    schemas = {"l": ONLY_LLGUIDANCE, "x": ONLY_XGRAMMAR, "e": EVERYWHERE}
    reqs = [constrained_req(f"{tag}{i}", seed=i, backend="auto", json_schema=json.dumps(schema), max_new_tokens=96)
            for tag, schema in schemas.items() for i in range(2)]
    assert {r.rid[0]: r.grammar.key.backend for r in reqs} == {"l": "llguidance", "x": "xgrammar", "e": "xgrammar"}
    result = run_to_completion(s, reqs)
    specs = {r.rid: r.grammar for r in reqs}
    for rid, text in texts(s, result).items():
        assert result.finish[rid]["type"] == "stop", (rid, result.finish[rid], text)
        assert specs[rid].validate_output(text) is None, (rid, text)
        jsonschema.validate(json.loads(text), schemas[rid[0]])
    assert s.stats["num_jump_forward_tokens"] > 0
    assert_idle_pools(s)
    s.grammar_manager.shutdown()


@pytest.fixture(scope="module")
def auto_engine(tiny_llama_dir):
    import arborlm

    engine = arborlm.Engine(model=str(tiny_llama_dir), dtype="float32", max_total_tokens=8192, random_seed=7,
                            log_level="warning", grammar_backend="auto")
    yield engine
    engine.shutdown()


def test_the_engine_says_which_backend_each_request_used(auto_engine):
    schemas = [ONLY_LLGUIDANCE, ONLY_XGRAMMAR]
    outs = auto_engine.generate(["a", "b"], [{"json_schema": json.dumps(s), "max_new_tokens": 96, "temperature": 1.0,
                                             "seed": 3} for s in schemas])
    assert [o["meta_info"]["grammar_backend"] for o in outs] == ["llguidance", "xgrammar"]
    for out, schema in zip(outs, schemas):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)
    plain = auto_engine.generate("c", {"max_new_tokens": 2})
    assert "grammar_backend" not in plain["meta_info"]
    with pytest.raises(GrammarError, match="llguidance backend refuses it too") as info:  # a 400 over HTTP
        auto_engine.generate("d", {"json_schema": json.dumps({"type": "array", "items": {"type": "string"},
                                                              "uniqueItems": True})})
    assert info.value.param == "json_schema"


def test_a_constraint_after_reasoning_goes_to_xgrammar_or_says_it_needs_it():
    from arborlm.runtime.reasoning_grammar import after_reasoning

    reasoning = {"begin": "<think>", "end": "</think>"}
    spec = spec_of(EVERYWHERE)
    combined = after_reasoning(spec, reasoning, resolved_backend(spec.key.backend, "auto"))
    assert combined.key.kind == "structural_tag" and resolved_backend(combined.key.backend, "auto") == "xgrammar"
    AutoGrammarBackend.check(combined.key)
    spec = spec_of(ONLY_LLGUIDANCE)
    with pytest.raises(GrammarError, match="goes to the llguidance backend; xgrammar must accept it") as info:
        after_reasoning(spec, reasoning, resolved_backend(spec.key.backend, "auto"))
    assert info.value.param == "json_schema"


def test_tool_calls_under_auto_compile_on_xgrammar():
    from arborlm.entrypoints.http_errors import APIError
    from arborlm.entrypoints.openai.protocol import ChatCompletionRequest
    from arborlm.entrypoints.openai.tool_calls import add_tool_grammar, plan_tools

    def request(parameters):
        return ChatCompletionRequest.model_validate({
            "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters, "strict": True}}]})

    plan = plan_tools(request(EVERYWHERE), "auto")
    spec = grammar_spec_from_params(SamplingParams(**add_tool_grammar({}, plan)), "auto")
    assert spec.key.kind == "structural_tag" and resolved_backend(spec.key.backend, "auto") == "xgrammar"
    AutoGrammarBackend.check(spec.key)
    # the calls' grammar is xgrammar's structural tag: a strict argument schema only llguidance
    # enforces whole is a 400 (without strict, xgrammar drops the decimal multipleOf and the
    # arguments are validated)
    with pytest.raises(APIError) as info:
        plan_tools(request(ONLY_LLGUIDANCE), "auto")
    assert info.value.status == 400 and info.value.param == "tools[0].function.parameters"
