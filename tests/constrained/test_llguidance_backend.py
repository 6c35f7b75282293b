"""The llguidance backend keeps the grammar-matcher contract of the other backends (masks, accept,
rollback, stop tokens, jump-forward), agrees with xgrammar and outlines-core on which outputs
a regex or schema allows (differences pinned), compiles tool-call structural tags, and refuses
what it cannot enforce with a GrammarError naming it.

Driven over SmolLM2's token ids, as the other backends' tests are."""

from __future__ import annotations

import json

import pytest
import torch

from arborlm.constrained.base import GrammarError, GrammarKey, allocate_vocab_mask
from arborlm.constrained.grammar_spec import grammar_spec_from_params
from arborlm.constrained.jump_forward import jump_forward_tokens
from arborlm.constrained.llguidance_backend import LLGuidanceBackend
from arborlm.constrained.vocab import special_token_ids
from arborlm.entrypoints.openai.tool_parsers.base import FunctionSpec
from arborlm.entrypoints.openai.tool_parsers.hermes import HermesFormat
from arborlm.entrypoints.openai.tool_parsers.registry import (
    Llama3Format,
    MistralFormat,
    PythonicFormat,
)
from arborlm.sampling_params import SamplingParams
from tests.constrained.test_backend_agreement import (
    AGREE,
    COMPLETE,
    ID_TAGS,
    INCOMPLETE,
    NAME_AGE,
    REJECTED,
    VOCAB_SIZE,
    allowed_ids,
    case_id,
    outcome,
)

STOP = 5  # a request's own stop id (an ordinary token of SmolLM2's vocabulary)

# Where llguidance differs from the AGREE table of xgrammar and outlines-core: (schema, text) -> outcome.
DIFFERENCES = {
    # JSON Schema's default: a property the schema does not name is allowed (xgrammar closes objects).
    (json.dumps(NAME_AGE), '{"name": "Bob", "age": 42, "x": 1}'): COMPLETE,
    # A number's fraction digits are not bounded on llguidance; integers are, to |n| <= 10**18
    # (llguidance cannot build the regex of int64's range), one digit less than xgrammar.
    (json.dumps({"type": "integer"}), "-" + "9" * 19): REJECTED,
    (json.dumps({"type": "number"}), "0." + "5" * 18): COMPLETE,
}


@pytest.fixture(scope="module")
def backend(tokenizer, eos) -> LLGuidanceBackend:
    return LLGuidanceBackend(tokenizer, VOCAB_SIZE, [eos])


@pytest.fixture(scope="module")
def compiled(backend):
    cache = {}

    def compiled(key: GrammarKey):
        if key not in cache:
            cache[key] = backend.compile(key)
        return cache[key]

    return compiled


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(("key", "text", "expected"), AGREE, ids=[case_id(k, t) for k, t, _ in AGREE])
def test_llguidance_agrees_with_the_other_backends(tokenizer, eos, compiled, key, text, expected):
    expected = DIFFERENCES.get((key.text, text), expected) if key.kind == "json_schema" else expected
    assert outcome(compiled(key).new_matcher(), encode(tokenizer, text), eos) == expected


def test_special_tokens_are_never_text_and_eos_only_where_the_grammar_may_end(tokenizer, eos, compiled):
    special = special_token_ids(tokenizer, VOCAB_SIZE)
    matcher = compiled(GrammarKey("json_schema", json.dumps({"type": "string"}))).new_matcher()
    for token_id in encode(tokenizer, '"a<|im_start|>b'):
        assert not (allowed_ids(matcher) & special)  # not even inside a JSON string
        assert matcher.accept_token(token_id) == (token_id not in special)
    assert not matcher.accept_token(eos)  # the string is not closed
    assert allowed_ids(matcher) & {eos} == set()
    assert matcher.accept_token(encode(tokenizer, '"')[0])
    assert allowed_ids(matcher) == {eos} and matcher.accept_token(eos) and matcher.is_terminated()
    assert allowed_ids(matcher) == {eos}  # a step too late samples a stop token


def test_a_rejected_token_leaves_the_state_and_rollback_undoes_eos(tokenizer, eos, compiled):
    key = GrammarKey("regex", r"(yes|no)")
    matcher = compiled(key).new_matcher()
    assert not matcher.accept_token(encode(tokenizer, "maybe")[0])
    assert outcome(matcher, encode(tokenizer, "yes"), eos) == COMPLETE
    assert matcher.is_terminated()
    matcher.rollback(1)  # the EOS
    assert not matcher.is_terminated() and allowed_ids(matcher) == {eos}
    matcher.rollback(len(encode(tokenizer, "yes")))
    assert outcome(matcher, encode(tokenizer, "no"), eos) == COMPLETE
    with pytest.raises(RuntimeError):
        compiled(key).new_matcher().rollback(3)


def test_request_stop_ids_are_held_back_until_the_grammar_may_end(tokenizer, eos, compiled):
    matcher = compiled(GrammarKey("regex", r"\d{2}")).new_matcher(stop_token_ids=[STOP])
    assert STOP not in allowed_ids(matcher) and not matcher.accept_token(STOP)
    for token_id in encode(tokenizer, "42"):
        assert matcher.accept_token(token_id)
    assert allowed_ids(matcher) == {eos, STOP}
    assert matcher.accept_token(STOP) and matcher.is_terminated()


def test_masks_of_matchers_are_independent_and_rows_are_written_alone(tokenizer, compiled):
    grammar = compiled(GrammarKey("regex", r"(cat|dog)"))
    first, second = grammar.new_matcher(), grammar.new_matcher()
    assert first.accept_token(encode(tokenizer, "c")[0])
    mask = allocate_vocab_mask(3, VOCAB_SIZE)
    first.fill_vocab_mask(mask, 0)
    second.fill_vocab_mask(mask, 2)
    assert torch.all(mask[1] == -1)  # the row of an unconstrained request stays all allowed
    assert not torch.equal(mask[0], mask[2])


def test_jump_forward_appends_the_forced_keys(tokenizer, eos, compiled):
    key = GrammarKey("json_schema", json.dumps(NAME_AGE))
    matcher = compiled(key).new_matcher()
    assert matcher.find_jump_forward_string() == '{"name": "'
    output = encode(tokenizer, '{"name": "Bob",')
    for token_id in output:
        assert matcher.accept_token(token_id)
    assert matcher.find_jump_forward_string() == ' "age": '
    forced = jump_forward_tokens(matcher, tokenizer, output, max_tokens=8)
    # The forced text's last token (" ") is left to decode: it may merge with what follows.
    assert tokenizer.decode(output + forced) == '{"name": "Bob", "age":'
    assert outcome(matcher, encode(tokenizer, " 7}"), eos) == COMPLETE


def _spec(backend_name: str = "llguidance", **fields):
    return grammar_spec_from_params(SamplingParams(**fields), backend_name)


def test_tool_call_structural_tags_compile_and_force_valid_calls(tokenizer, eos, backend):
    weather = FunctionSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                           "required": ["city"]})
    fmt = HermesFormat()
    auto = GrammarKey("structural_tag", json.dumps({"type": "structural_tag",
                                                     "format": fmt.structural_tag([weather], "auto", True)}))
    required = GrammarKey("structural_tag", json.dumps({"type": "structural_tag",
                                                         "format": fmt.structural_tag([weather], "required", False)}))
    LLGuidanceBackend.check(auto)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert outcome(backend.compile(auto).new_matcher(), encode(tokenizer, f"Let me check. {call}"), eos) == COMPLETE
    assert outcome(backend.compile(auto).new_matcher(), encode(tokenizer, "No call needed."), eos) == COMPLETE
    wrong = '<tool_call>\n{"name": "get_time"'
    assert outcome(backend.compile(auto).new_matcher(), encode(tokenizer, wrong), eos) == REJECTED
    bad_args = call.replace('"Paris"', "3")
    assert outcome(backend.compile(auto).new_matcher(), encode(tokenizer, bad_args), eos) == REJECTED
    assert outcome(backend.compile(required).new_matcher(), encode(tokenizer, call), eos) == COMPLETE
    assert outcome(backend.compile(required).new_matcher(), encode(tokenizer, "Hi"), eos) == REJECTED


TOOLS = [FunctionSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"},
                                                                       "days": {"type": "integer"}},
                                       "required": ["city"]}),
         FunctionSpec("noop", {"type": "object", "properties": {}})]


@pytest.mark.parametrize("fmt", [HermesFormat(), Llama3Format(), MistralFormat(), PythonicFormat()],
                         ids=lambda f: type(f).__name__)
@pytest.mark.parametrize(("choice", "parallel", "named"), [("auto", True, None), ("required", False, None),
                                                           ("named", True, "get_weather")])
def test_every_tool_call_format_compiles_and_takes_its_own_calls(tokenizer, eos, backend, fmt, choice, parallel,
                                                                 named):
    # The pythonic format's argument grammar is xgrammar EBNF (lookaheads, "{0, -1}", "\\-"): converted.
    key = GrammarKey("structural_tag", json.dumps({"type": "structural_tag",
                                                   "format": fmt.structural_tag(TOOLS, choice, parallel, named)}))
    grammar = backend.compile(key)
    call = fmt.history_text([("get_weather", {"city": "Paris", "days": 3})])
    assert outcome(grammar.new_matcher(), encode(tokenizer, call), eos) == COMPLETE, call
    wrong = fmt.history_text([("get_weather", {"town": "Paris"})])
    assert outcome(grammar.new_matcher(), encode(tokenizer, wrong), eos) == REJECTED, wrong


def test_legacy_structural_tag_and_ebnf_forms(tokenizer, eos, backend):
    legacy = {"structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}], "triggers": ["<f"]}
    key = GrammarKey("structural_tag", json.dumps(legacy))
    assert outcome(backend.compile(key).new_matcher(), encode(tokenizer, "a <f>12</f> b"), eos) == COMPLETE
    assert outcome(backend.compile(key).new_matcher(), encode(tokenizer, "a <f>x"), eos) == REJECTED
    for grammar in ('root ::= "a" [0-9]+', 'start: "a" /[0-9]+/'):  # GBNF and Lark
        key = GrammarKey("ebnf", grammar)
        assert outcome(backend.compile(key).new_matcher(), encode(tokenizer, "a12"), eos) == COMPLETE
        assert outcome(backend.compile(key).new_matcher(), encode(tokenizer, "b"), eos) == REJECTED


@pytest.mark.parametrize(("fields", "match"), [
    ({"json_schema": json.dumps({"not": {"pattern": "x"}, "type": "string"})}, "not"),
    ({"json_schema": json.dumps({"type": "object", "anyOf": [{"properties": {"a": {}}}],
                                 "unevaluatedProperties": False})}, "unevaluatedProperties"),
    ({"json_schema": json.dumps({"properties": {"a": {"$ref": "https://example.com/a.json"}}})},
     "does not fetch"),
    ({"json_schema": json.dumps({"$ref": "#/$defs/missing"})}, "missing"),
    ({"regex": "(a"}, "regex"),
    ({"ebnf": 'root ::= "a" undefined_rule'}, "undefined_rule"),
    ({"structural_tag": json.dumps({"type": "sideways"})}, "sideways"),
], ids=["not", "unevaluated", "remote-ref", "missing-ref", "regex", "ebnf", "tag"])
def test_what_llguidance_cannot_enforce_is_refused_by_name(fields, match):
    with pytest.raises(GrammarError, match=match) as info:
        _spec(**fields)
    assert info.value.param == next(iter(fields))


def test_lenient_mode_turns_on_llguidances_own_leniency(tokenizer, eos, backend):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "not": {"multipleOf": 3}}}, "required": ["a"]}
    spec = _spec(json_schema=json.dumps(schema), json_schema_lenient=True)
    assert spec.key.lenient and spec.dropped == ("not at /properties/a",)  # named, as on the other backends
    matcher = backend.compile(spec.key).new_matcher()
    assert outcome(matcher, encode(tokenizer, '{"a": 3}'), eos) == COMPLETE  # `not` left to the validation
    assert spec.validate_output('{"a": 3}') is not None and spec.validate_output('{"a": 4}') is None


def test_an_unknown_format_is_left_out_and_the_output_still_validated(tokenizer, eos, backend):
    spec = _spec(json_schema=json.dumps({"type": "string", "format": "uri-reference", "maxLength": 5}))
    assert outcome(backend.compile(spec.key).new_matcher(), encode(tokenizer, '"a/b"'), eos) == COMPLETE
    assert outcome(backend.compile(spec.key).new_matcher(), encode(tokenizer, '"abcdef"'), eos) == REJECTED


def test_compile_worker_payload_round_trips(tokenizer, eos, backend):
    key = GrammarKey("json_schema", json.dumps(ID_TAGS))
    payload = backend.compile_serialized(key)
    assert isinstance(payload, str) and backend.worker_args() is not None
    assert outcome(backend.load_compiled(key, payload).new_matcher(), encode(tokenizer, '{"id": 1}'), eos) == COMPLETE
    assert outcome(backend.load_compiled(key, payload).new_matcher(), encode(tokenizer, '{"id": 1'), eos) == INCOMPLETE


def test_integer_digits_are_bounded_unless_lenient(tokenizer, eos, backend):
    for lenient, expected in ((False, REJECTED), (True, COMPLETE)):
        key = GrammarKey("json_schema", json.dumps({"type": "integer"}), lenient=lenient)
        assert outcome(backend.compile(key).new_matcher(), encode(tokenizer, "1" * 19), eos) == expected
        assert outcome(backend.compile(key).new_matcher(), encode(tokenizer, "-" + "9" * 18), eos) == COMPLETE
    ranged = GrammarKey("json_schema", json.dumps({"type": "integer", "minimum": 0}))  # its own range: kept
    assert outcome(backend.compile(ranged).new_matcher(), encode(tokenizer, "1" * 25), eos) == COMPLETE


def test_the_backend_needs_an_eos_id(tokenizer):
    with pytest.raises(ValueError, match="EOS"):
        LLGuidanceBackend(tokenizer, VOCAB_SIZE, [])
