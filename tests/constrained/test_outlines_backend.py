"""OutlinesBackend on SmolLM2's tokenizer: matchers driven by hand token by token."""

from __future__ import annotations

import json

import pytest
import torch

from arborlm.constrained import outlines_backend
from arborlm.constrained.base import GrammarError, GrammarKey, allocate_vocab_mask
from arborlm.constrained.outlines_backend import (
    MAX_EXPANDED_REGEX_SIZE,
    MAX_ROLLBACK_TOKENS,
    OutlinesBackend,
)
from arborlm.constrained.regex_size import regex_shape

TOKENIZER_VOCAB = 49152
VOCAB_SIZE = TOKENIZER_VOCAB + 40  # logits wider than the tokenizer, and not a multiple of 32
NAME_AGE = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"]}
NODE = {"type": "object", "properties": {"value": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}}}
SHARED_DEFS = {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
               "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
               "required": ["a", "b"]}


def regex(text: str) -> GrammarKey:
    return GrammarKey("regex", text)


def schema(value) -> GrammarKey:
    return GrammarKey("json_schema", json.dumps(value))  # property order is the output order


# (key, a complete output valid under it)
VALID = [
    (regex(r"\d{4}-\d{2}-\d{2}"), "2024-02-29"),
    (regex(r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}"), "jane.doe+x@mail.example.org"),
    (regex(r"(cat|dog|bird)s?"), "dogs"),
    (regex(r"(a|ab)"), "ab"),  # outlines-core's leftmost-first DFA alone would stop after "a"
    (regex(r"\d+(\.\d+)?"), "3.14"),  # and would drop "." after the final state "3"
    (regex(r"(yes|yesterday)"), "yesterday"),
    (regex(r"\p{L}+ \p{Greek}+"), "héllo αβγ"),
    (regex(r"[\u4e00-\u9fff]{2}!"), "日本!"),
    (regex(r"^\w+ \d+$"), "abc 42"),
    (regex(r"Answer: (yes|no)"), "Answer: no"),
    (schema(NAME_AGE), '{"name": "Bob", "age": 42}'),
    (schema(NAME_AGE), '{"name":"Zoë","age":-7}'),
    (schema(SHARED_DEFS), '{"a": {"x": 1}, "b": {"x": 2}}'),
    (schema({"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2}), '["red", "green"]'),
    (schema({"type": "string", "format": "date"}), '"2024-01-31"'),
    (schema({"type": "object", "additionalProperties": {"type": "integer"}}), '{"a": 1, "b": 2}'),
    (schema({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {}}), '{"a": 1}'),
]

# (key, the param the error must name, a fragment of the message)
INVALID = [
    (regex("a(b"), "regex", "outlines-core cannot use this regex"),
    (regex("[z-a]"), "regex", "cannot use"),
    (regex("(?=a)b"), "regex", "look-around"),
    (regex(r"(a)\1"), "regex", "cannot use"),
    (regex(r"a\bc"), "regex", "cannot use"),
    (regex("a$b"), "regex", "cannot use"),
    (GrammarKey("json_schema", '{"type": '), "json_schema", "not valid JSON"),
    (GrammarKey("json_schema", "[1]"), "json_schema", "an object"),
    (schema({"type": "foo"}), "json_schema", "Unsupported type: foo"),
    (schema({"type": "string", "format": "hostname"}), "json_schema", "hostname"),
    (schema({"type": "string", "pattern": "a("}), "json_schema", "regex of the JSON schema"),
    (schema({"$ref": "#/$defs/missing"}), "json_schema", "Invalid reference path"),
    (schema({"$defs": {"node": NODE}, "$ref": "#/$defs/node"}), "json_schema",
     'recursive $ref "#/$defs/node" at $.$defs.node.properties.next.$ref'),
    (schema({"type": "object", "properties": {"child": {"$ref": "#"}}}), "json_schema",
     'recursive $ref "#" at $.properties.child.$ref'),
    (schema({"definitions": {"list": {"type": "array", "items": {"$ref": "#/definitions/list"}}},
             "type": "object", "properties": {"tree": {"$ref": "#/definitions/list"}}}), "json_schema",
     'recursive $ref "#/definitions/list" at $.definitions.list.items.$ref'),
    (schema({"type": "integer", "minimum": 3}), "json_schema", 'ignores "minimum", so the output could break it (at $);'),
    (schema({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}), "json_schema",
     '"uniqueItems", so the output could break it (at $.properties.tags)'),
    (schema({"allOf": [{"type": "integer"}, {"type": "integer"}]}), "json_schema", "several allOf"),
    (GrammarKey("json_schema", "$$ANY$$"), "json_schema", "cannot bound any JSON value (a regex nested"),
    (schema({"description": "anything"}), "json_schema", "any JSON value"),
    (schema({"type": "object", "properties": {"meta": {"type": "object"}}}), "json_schema",
     "an object without properties (a regex nested to a fixed depth, slow to compile) (at $.properties.meta)"),
    (schema({"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "array"}]}}), "json_schema",
     "an array without items (a regex nested to a fixed depth, slow to compile) (at $.items.anyOf[1])"),
    (schema({"type": "string", "pattern": "a+", "minLength": 3}), "json_schema", "pattern + minLength/maxLength"),
    (schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}), "json_schema",
     'required property "b"'),
    (schema({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2}), "json_schema", "prefixItems"),
    (GrammarKey("ebnf", 'root ::= "a"'), "ebnf", "does not support ebnf"),
    (GrammarKey("json_object", ""), "json_schema", "does not support json_object"),
]


@pytest.fixture(scope="module")
def backend(tokenizer, eos):
    return OutlinesBackend(tokenizer, VOCAB_SIZE, [eos])


@pytest.fixture(scope="module")
def compile_key(backend):
    """backend.compile, cached for the module (compiled grammars are immutable to matchers)."""
    cache = {}

    def compile_key(key: GrammarKey):
        if key not in cache:
            cache[key] = backend.compile(key)
        return cache[key]

    return compile_key


def allowed_ids(vocab_mask: torch.Tensor, row: int = 0) -> set[int]:
    bits = (vocab_mask[row].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1  # (V/32, 32)
    return set(bits.flatten().nonzero().flatten().tolist())


def current_mask(matcher) -> set[int]:
    vocab_mask = allocate_vocab_mask(1, VOCAB_SIZE)
    matcher.fill_vocab_mask(vocab_mask, 0)
    return allowed_ids(vocab_mask)


def drive(matcher, token_ids: list[int]) -> None:
    """Accept ``token_ids`` one by one, each allowed by the mask first."""
    for token_id in token_ids:
        assert token_id in current_mask(matcher)
        assert matcher.accept_token(token_id)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_vocabulary_holds_the_bytes_each_token_stands_for(tokenizer, backend, eos):
    token_bytes = backend.token_bytes
    assert len(token_bytes) == VOCAB_SIZE
    assert token_bytes[tokenizer.convert_tokens_to_ids("Ġhello")] == b" hello"
    assert token_bytes[tokenizer.convert_tokens_to_ids("Ċ")] == b"\n"
    text = "Héllo wörld — ✓ 日本語\n\tend"
    assert b"".join(token_bytes[i] for i in encode(tokenizer, text)) == text.encode()
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    assert special >= set(tokenizer.all_special_ids) and len(special) == 17
    assert all(token_bytes[i] is None for i in special)  # <|im_start|>, <file_sep>, ... and EOS
    assert token_bytes[eos] is None
    assert all(text is None for text in token_bytes[TOKENIZER_VOCAB:])
    assert backend.token_bytes[backend.end_mark_id] is None


def test_sentencepiece_vocabulary_with_byte_fallback():
    """A Llama-2-style tokenizer built in memory: "▁" is a space, "<0xAB>" a raw byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3, "<0xC3>": 4, "<0xA9>": 5, "▁": 6, "h": 7, "i": 8,
             "▁hi": 9, "é": 10}
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.add_tokens(["<tool>"])
    backend = OutlinesBackend(tokenizer, 16, [2])
    assert backend.token_bytes == [None, None, None, b"\n", b"\xc3", b"\xa9", b" ", b"h", b"i", b" hi", "é".encode(),
                                   b"<tool>", None, None, None, None]
    matcher = backend.compile(regex(r" hi\né")).new_matcher()
    assert matcher.find_jump_forward_string() == " hi\né"
    assert all(matcher.accept_token(i) for i in (9, 3, 4, 5, 2)) and matcher.is_terminated()


@pytest.mark.parametrize(("key", "text"), VALID, ids=[f"{k.kind}:{t}" for k, t in VALID])
def test_valid_output_is_accepted_token_by_token(tokenizer, eos, compile_key, key, text):
    OutlinesBackend.check(key)
    matcher = compile_key(key).new_matcher()
    drive(matcher, encode(tokenizer, text))
    assert eos in current_mask(matcher)
    assert matcher.accept_token(eos)
    assert matcher.is_terminated()
    assert not matcher.accept_token(eos)
    assert current_mask(matcher) == {eos}


def test_mask_disallows_what_breaks_the_grammar(tokenizer, eos, compile_key):
    matcher = compile_key(regex(r"\d{4}-\d{2}-\d{2}")).new_matcher()
    drive(matcher, encode(tokenizer, "2024-0"))
    allowed = current_mask(matcher)
    for text in ("1", "9"):
        assert tokenizer.convert_tokens_to_ids(text) in allowed
    for text in ("-", "a", "Ġ", "12"):
        assert tokenizer.convert_tokens_to_ids(text) not in allowed
    assert eos not in allowed
    assert not any(i >= TOKENIZER_VOCAB for i in allowed)  # padding columns of the logits
    assert not allowed & set(tokenizer.all_special_ids)
    before = current_mask(matcher)
    for token_id in (tokenizer.convert_tokens_to_ids("-"), eos, VOCAB_SIZE - 1, VOCAB_SIZE + 5, -1):
        assert not matcher.accept_token(token_id)
    assert current_mask(matcher) == before  # rejected tokens leave the state alone


def test_free_text_allows_every_whole_text_token_but_no_special_or_padding(compile_key, backend):
    matcher = compile_key(regex(r"(?s:.)+")).new_matcher()
    allowed = current_mask(matcher)
    grammar_tokens = {i for i, text in enumerate(backend.token_bytes) if text is not None}
    assert {i for i in grammar_tokens if is_utf8(backend.token_bytes[i])} <= allowed
    assert allowed <= grammar_tokens
    assert max(allowed) < TOKENIZER_VOCAB


def is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_eos_is_allowed_only_in_final_states(tokenizer, eos, compile_key):
    matcher = compile_key(regex(r"\d+(\.\d+)?")).new_matcher()
    assert eos not in current_mask(matcher)
    assert not matcher.accept_token(eos)
    finals = []
    for token_id in encode(tokenizer, "3.14"):
        drive(matcher, [token_id])
        finals.append(eos in current_mask(matcher))
    assert finals == [True, False, True, True]
    assert not matcher.is_terminated()  # "3.14" may go on ("3.141")


def test_final_state_with_no_way_on_allows_only_eos(tokenizer, eos, compile_key):
    """As xgrammar: the grammar ends on the EOS it then forces, not on the last content token."""
    matcher = compile_key(regex("(yes|no)")).new_matcher()
    drive(matcher, encode(tokenizer, "ye"))
    assert not matcher.is_terminated()
    drive(matcher, encode(tokenizer, "s"))
    assert not matcher.is_terminated()
    assert current_mask(matcher) == {eos}
    assert matcher.find_jump_forward_string() == ""
    assert matcher.accept_token(eos) and matcher.is_terminated()


def test_rollback_restores_earlier_states(tokenizer, eos, compile_key):
    matcher = compile_key(schema(NAME_AGE)).new_matcher()
    ids = encode(tokenizer, '{"name": "Al", "age": 7}')
    masks = [current_mask(matcher)]
    for token_id in ids:
        drive(matcher, [token_id])
        masks.append(current_mask(matcher))
    assert matcher.accept_token(eos) and matcher.is_terminated()
    matcher.rollback(1)  # the EOS: back in the final state after "}", where only EOS is allowed
    assert current_mask(matcher) == masks[-1] == {eos}
    matcher.rollback(3)
    assert current_mask(matcher) == masks[-4]
    drive(matcher, ids[-3:])
    assert current_mask(matcher) == masks[-1]
    matcher.rollback(0)
    matcher.rollback(len(ids))
    assert current_mask(matcher) == masks[0]
    with pytest.raises(RuntimeError, match="cannot roll back"):
        matcher.rollback(1)


def test_rollback_is_bounded(tokenizer, compile_key):
    matcher = compile_key(regex("a*")).new_matcher()
    a = tokenizer.convert_tokens_to_ids("a")
    for _ in range(MAX_ROLLBACK_TOKENS + 5):
        assert matcher.accept_token(a)
    matcher.rollback(MAX_ROLLBACK_TOKENS)
    with pytest.raises(RuntimeError, match="cannot roll back"):
        matcher.rollback(1)


@pytest.mark.parametrize(("key", "prefix", "forced"), [
    (regex(r"Answer: (yes|no)"), "", "Answer: "),
    (regex(r"Answer: (yes|no)"), "Answer: y", "es"),
    (regex(r"Answer: (yes|no)"), "Answer: ", ""),
    (regex(r"café \d"), "ca", "fé "),
    (regex(r"\d{4}-\d{2}"), "2024", "-"),
    (regex(r"(yes|no)"), "yes", ""),
    (schema(NAME_AGE), '{"na', 'me"'),
    (schema(NAME_AGE), '{"name": "Al",', ""),  # a space may follow
    (schema(NAME_AGE), '{"name": "Al", ', '"age"'),
    (schema({"enum": ["interstellar"]}), '"inter', 'stellar"'),
])
def test_jump_forward_string_is_the_forced_text(tokenizer, compile_key, key, prefix, forced):
    matcher = compile_key(key).new_matcher()
    drive(matcher, encode(tokenizer, prefix))
    before = current_mask(matcher)
    assert matcher.find_jump_forward_string() == forced
    assert current_mask(matcher) == before  # the matcher did not move
    drive(compile_key(key).new_matcher(), encode(tokenizer, prefix + forced))  # the forced text is valid


def test_jump_forward_string_is_empty_once_terminated(tokenizer, eos, compile_key):
    matcher = compile_key(regex("ok!")).new_matcher()
    drive(matcher, encode(tokenizer, "ok!"))
    assert matcher.accept_token(eos)
    assert matcher.find_jump_forward_string() == ""


def test_mask_rows_of_a_batch(tokenizer, compile_key):
    vocab_mask = allocate_vocab_mask(3, VOCAB_SIZE)
    matcher = compile_key(regex("(yes|no)")).new_matcher()
    matcher.fill_vocab_mask(vocab_mask, 1)
    assert (vocab_mask[0] == -1).all() and (vocab_mask[2] == -1).all()
    allowed = allowed_ids(vocab_mask, 1)
    assert tokenizer.convert_tokens_to_ids("yes") in allowed and tokenizer.convert_tokens_to_ids("no") in allowed
    assert all(tokenizer.decode([i]) in ("y", "ye", "yes", "n", "no") for i in allowed)


@pytest.mark.parametrize(("key", "param", "message"), INVALID, ids=[f"{k.kind}:{k.text[:40]}" for k, _, _ in INVALID])
def test_invalid_grammar_is_a_grammar_error(key, param, message):
    with pytest.raises(GrammarError) as info:
        OutlinesBackend.check(key)
    assert info.value.param == param
    assert message in info.value.message


@pytest.mark.parametrize("key", [k for k, _, _ in INVALID if k.kind in OutlinesBackend.kinds][:14:4])
def test_compile_refuses_what_check_refuses(backend, key):
    with pytest.raises(GrammarError) as info:
        backend.compile(key)
    assert info.value.param == key.param


def test_shorthand_classes_are_ascii(tokenizer, compile_key):
    """``\\d`` and ``\\w`` mean ASCII, as in JSON Schema and xgrammar (Rust's would take any script)."""
    for key, text in [(regex(r"\d"), "٣"), (regex(r"\w"), "é"), (schema({"type": "string", "format": "date"}), '"٢')]:
        matcher = compile_key(key).new_matcher()
        ids = encode(tokenizer, text)
        assert not all(matcher.accept_token(i) for i in ids)


# (schema, what lenient mode lists in dropped, an output the relaxed grammar writes)
LENIENT = [
    ({"type": "integer", "minimum": 3, "maximum": 9}, ["minimum at /", "maximum at /"], "7"),
    ({"type": "object", "properties": {"n": {"type": "number", "exclusiveMinimum": 0}}, "required": ["n"]},
     ["exclusiveMinimum at /properties/n"], '{"n": 2.5}'),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, ["uniqueItems at /"], '["a", "b"]'),
    ({"$defs": {"node": NODE}, "$ref": "#/$defs/node"},
     ["$ref at /$defs/node/properties/next/$ref (recursion unrolled to a fixed depth)"], '{"value": 1, "next": {"value": 2}}'),
    ({"type": "object", "properties": {"meta": {"type": "object"}}, "required": ["meta"]},
     ["type at /properties/meta (an object without properties, nested to a fixed depth)"], '{"meta": {"k": [1, "v"]}}'),
]


@pytest.mark.parametrize(("value", "dropped", "text"), LENIENT, ids=[str(i) for i in range(len(LENIENT))])
def test_lenient_mode_relaxes_what_outlines_enforces_only_in_part(tokenizer, eos, compile_key, value, dropped, text):
    from arborlm.constrained.grammar_spec import grammar_spec_from_params
    from arborlm.sampling_params import SamplingParams

    with pytest.raises(GrammarError, match="Set json_schema_lenient"):
        grammar_spec_from_params(SamplingParams(json_schema=value), "outlines")
    spec = grammar_spec_from_params(SamplingParams(json_schema=value, json_schema_lenient=True), "outlines")
    assert set(dropped) <= set(spec.dropped), spec.dropped
    matcher = compile_key(spec.key).new_matcher()
    drive(matcher, encode(tokenizer, text))
    assert matcher.accept_token(eos)
    assert spec.validate_output(text) is None  # the user's whole schema still judges the output
    on_xgrammar = grammar_spec_from_params(SamplingParams(json_schema=value, json_schema_lenient=True), "xgrammar")
    assert set(on_xgrammar.dropped) <= set(spec.dropped)  # outlines drops what no backend enforces, and more


def test_lenient_mode_output_is_still_validated_against_the_dropped_bound(tokenizer, eos, compile_key):
    from arborlm.constrained.grammar_spec import grammar_spec_from_params
    from arborlm.sampling_params import SamplingParams

    spec = grammar_spec_from_params(SamplingParams(json_schema={"type": "integer", "minimum": 3},
                                                   json_schema_lenient=True), "outlines")
    matcher = compile_key(spec.key).new_matcher()
    drive(matcher, encode(tokenizer, "1"))  # the grammar no longer holds the bound...
    assert "minimum" in spec.validate_output("1")  # ...the final validation does


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"type": "object", "properties": {"x": {}}}, "any JSON value"),
        ({"description": "anything"}, "any JSON value"),
    ],
)
def test_lenient_mode_still_refuses_what_outlines_cannot_run(value, message):
    from arborlm.constrained.grammar_spec import grammar_spec_from_params
    from arborlm.sampling_params import SamplingParams

    with pytest.raises(GrammarError) as info:
        grammar_spec_from_params(SamplingParams(json_schema=value, json_schema_lenient=True), "outlines")
    assert message in info.value.message and "use the xgrammar backend" in info.value.message
    assert "json_schema_lenient" not in info.value.message


# Ambiguous inside a nested array (a pattern's class takes the closing quote), as JSONSchemaBench's
# Github_hard/o12409: outlines-core's DFA of it grows for minutes and gigabytes.
AMBIGUOUS_STEP = {"type": "object", "properties": {"location": {"type": "string", "pattern": "top-left|top-right"},
                                                    "text": {"type": "string"}}, "required": ["text"]}
AMBIGUOUS = schema({"type": "object", "properties": {"levels": {"type": "array", "items": {
    "type": "object", "properties": {"steps": {"type": "array", "items": AMBIGUOUS_STEP}}}}}})


def test_the_front_check_reads_the_regex_and_leaves_the_dfa_to_compile(monkeypatch):
    built = []
    monkeypatch.setattr(outlines_backend, "_build_index", lambda key, regex, vocabulary: built.append(key.text))
    OutlinesBackend.check(AMBIGUOUS)
    OutlinesBackend.check(schema({"type": "string", "maxLength": 32767}))
    OutlinesBackend.check(regex(r"\d{3}-[a-z]+"))
    assert built == []
    # What Python's parser cannot read, or a DFA cannot hold, is still built over bytes in the front.
    for key in (regex("a(b"), regex("(?=a)b"), regex(r"(a)\1"), regex(r"\p{Greek}+")):
        OutlinesBackend.check(key)
    assert built == ["a(b", "(?=a)b", r"(a)\1", r"\p{Greek}+"]


def test_repetitions_past_the_budget_are_refused_in_the_front():
    size = regex_shape(outlines_backend._regex_of(schema({"type": "string", "maxLength": 1000}))).expanded_size
    assert 1000 <= size < MAX_EXPANDED_REGEX_SIZE
    OutlinesBackend.check(schema({"type": "string", "maxLength": 1000}))
    with pytest.raises(GrammarError) as info:
        OutlinesBackend.check(schema({"type": "object", "properties": {
            "a": {"type": "string", "maxLength": MAX_EXPANDED_REGEX_SIZE}}}))
    assert info.value.param == "json_schema" and "bounded repetitions" in info.value.message
    with pytest.raises(GrammarError) as info:
        OutlinesBackend.check(regex("(ab{0,1000}){0,1000}"))
    assert info.value.param == "regex" and "about 1001000 positions" in info.value.message


def test_a_regex_rust_alone_reads_is_still_served(tokenizer, eos, compile_key):
    matcher = compile_key(regex(r"\p{Greek}+")).new_matcher()
    assert all(matcher.accept_token(t) for t in tokenizer.encode("αβγ", add_special_tokens=False))
    assert matcher.accept_token(eos)
