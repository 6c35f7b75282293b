"""Grammar-constrained requests through the Engine on the tiny random Llama: how refusals,
stops and the final validation show in the results."""

from __future__ import annotations

import json

import pytest

from arborlm.errors import InvalidRequestError

FLAG = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
CONSTRAINED = {"temperature": 0, "max_new_tokens": 32, "json_schema": FLAG}
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": 5}}}


def violations(engine) -> int:
    return engine.get_server_info()["num_grammar_violations"]


def test_refused_grammar_in_a_batch_fails_that_item_alone(engine):
    params = [CONSTRAINED, {**CONSTRAINED, "json_schema": BAD_SCHEMA}, {"max_new_tokens": 4, "regex": "(unclosed"}]
    good, bad_schema, bad_regex = engine.generate(["one", "two", "three"], params)
    assert good["meta_info"]["finish_reason"]["type"] == "stop"
    assert json.loads(good["text"])["a"] in (True, False)
    for out, param in ((bad_schema, "json_schema"), (bad_regex, "regex")):
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["param"] == param and reason["message"], reason
        assert out["text"] == "" and out["output_ids"] == []
        assert out["meta_info"]["completion_tokens"] == 0 and out["meta_info"]["prompt_tokens"] > 0
        assert out["meta_info"]["matched_stop"] is None


def test_refused_grammar_of_a_single_request_raises(engine):
    with pytest.raises(InvalidRequestError) as err:
        engine.generate("one", {**CONSTRAINED, "json_schema": BAD_SCHEMA})
    assert err.value.param == "json_schema"
    with pytest.raises(InvalidRequestError) as err:
        engine.generate("one", {"regex": "(unclosed", "n": 1})
    assert err.value.param == "regex"


def test_malformed_item_still_rejects_the_whole_batch(engine):
    with pytest.raises(InvalidRequestError) as err:
        engine.generate(["one", "two"], [{**CONSTRAINED, "json_schema": BAD_SCHEMA}, {"temperature": -1}])
    assert err.value.param == "temperature"
    assert engine.get_server_info()["num_running_reqs"] == 0


def test_kept_special_tokens_do_not_fail_validation(engine):
    """With skip_special_tokens=False the text ends in the EOS's text, which is not part of the JSON."""
    before = violations(engine)
    out = engine.generate("flag", {**CONSTRAINED, "skip_special_tokens": False})
    meta = out["meta_info"]
    eos = out["output_ids"][-1]
    assert meta["finish_reason"] == {"type": "stop", "matched": eos} and meta["matched_stop"] == eos
    eos_text = engine.tokenizer.decode([eos], skip_special_tokens=False)
    assert eos_text and out["text"].endswith(eos_text)  # returned as asked
    assert json.loads(out["text"].removesuffix(eos_text))["a"] in (True, False)
    assert violations(engine) == before


def test_stop_string_inside_constrained_output_is_a_stop_not_an_abort(engine):
    """A user stop string cuts the JSON: like a length finish, the text is a prefix, not validated."""
    before = violations(engine)
    out = engine.generate("flag", {**CONSTRAINED, "stop": '":'})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": '":'}
    assert out["meta_info"]["matched_stop"] == '":'
    assert out["text"] == '{"a'
    assert violations(engine) == before
