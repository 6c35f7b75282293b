"""Speculation through the Engine (front, zmq, scheduler process) on the tiny random Llama.

Compared with the conftest engine (speculation off): the same greedy text for
plain, streamed and JSON-schema requests; every constrained output validates;
meta_info counts verify steps and accepted drafts; /get_server_info gives the
mean accept length; bad speculative arguments stop start-up with an error
naming them.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

import arborlm
from arborlm.entrypoints.metrics import ServerMetrics

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "maxItems": 6}},
    "required": ["name", "tags"],
}
# Copy-heavy prompts: the answer may repeat what the prompt repeats.
PROMPTS = [
    "alpha beta gamma alpha beta gamma alpha beta gamma alpha beta",
    '{"name": "ab", "tags": ["alpha", "beta"]} {"name": "ab", "tags": ["alpha", "beta"]} {"name":',
    "one two three four one two three four one two",
]


@pytest.fixture(scope="module")
def spec_engine(tiny_llama_dir):
    engine = arborlm.Engine(model=str(tiny_llama_dir), dtype="float32", max_total_tokens=8192, random_seed=1234,
                            log_level="warning", speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                            # Every draft verified: these tests need the verify path to run whatever
                            # this machine's timings (the cost-aware switch has its own tests).
                            speculative_adaptive=False)
    yield engine
    engine.shutdown()


def test_plain_and_streamed_text_equal_speculation_off(spec_engine, engine):
    params = {"temperature": 0, "max_new_tokens": 40}
    want = engine.generate(PROMPTS, params)
    got = spec_engine.generate(PROMPTS, params)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["text"] for g in got] == [w["text"] for w in want]
    chunks = list(spec_engine.generate(PROMPTS[0], params, stream=True))
    assert "".join(c["text"] for c in chunks) == want[0]["text"]
    meta = [g["meta_info"] for g in got]
    assert sum(m.get("spec_accepted_tokens", 0) for m in meta) > 0
    assert all(m.get("spec_verify_ct", 0) >= 1 for m in meta if m.get("spec_accepted_tokens"))
    info = spec_engine.get_server_info(check_invariants=True)
    assert info["avg_spec_accept_length"] > 1.0
    assert info["speculative_algorithm"] == "NGRAM"
    # A request no step verified still reports the counts (0), as SGLang does with speculation on;
    # without speculation they are absent.
    one = spec_engine.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 1})["meta_info"]
    assert one["spec_verify_ct"] == 0 and one["spec_accepted_tokens"] == 0
    assert "spec_verify_ct" not in engine.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 1})["meta_info"]


def test_json_schema_outputs_validate_and_equal_speculation_off(spec_engine, engine):
    params = {"temperature": 0, "max_new_tokens": 80, "json_schema": SCHEMA}
    want = engine.generate(PROMPTS, params)
    got = spec_engine.generate(PROMPTS, params)
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"]
        if g["meta_info"]["finish_reason"]["type"] == "stop":
            jsonschema.validate(json.loads(g["text"]), SCHEMA)
    assert any(g["meta_info"].get("spec_verify_ct") for g in got), "no constrained request was verified"
    spec_engine.get_server_info(check_invariants=True)


def test_metrics_export_the_mean_accept_length():
    metrics = ServerMetrics("m")
    metrics.update_from_scheduler({"max_total_tokens": 10, "free_kv_tokens": 5, "evictable_kv_tokens": 0,
                                   "num_running_reqs": 0, "num_waiting_reqs": 0, "cache_hit_rate": 0.0,
                                   "avg_spec_accept_length": 2.5})
    text = metrics.render().decode()
    assert 'spec_accept_length{model_name="m"} 2.5' in text


@pytest.mark.parametrize("kwargs, name, error", [
    ({"speculative_algorithm": "EAGLE7"}, "speculative_algorithm", ValueError),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens", ValueError),
    ({"speculative_num_draft_tokens": 1000}, "speculative_num_draft_tokens", ValueError),
    ({"speculative_num_draft_tokens": 2.5}, "speculative_num_draft_tokens", TypeError),
    ({"speculative_ngram_min_match_window_size": 5, "speculative_ngram_max_match_window_size": 3},
     "speculative_ngram_max_match_window_size", ValueError),
    ({"speculative_disable_by_batch_size": -1}, "speculative_disable_by_batch_size", ValueError),
    ({"speculative_adaptive": "yes"}, "speculative_adaptive", TypeError),
])
def test_bad_speculative_arguments_stop_start_up(tiny_llama_dir, kwargs, name, error):
    with pytest.raises(error, match=name):
        arborlm.Engine(model=str(tiny_llama_dir), dtype="float32", **kwargs)
