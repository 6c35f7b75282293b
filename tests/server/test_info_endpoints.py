"""SGLang's small endpoints on the tiny model's server: /tokenize, /detokenize (SGLang's shapes, against
the tokenizer), /get_load, /version, and /metrics under SGLang's `sglang:` names with the TPOT and
queue-time histograms and the aborted / retracted / structured-output counters."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from arborlm.version import __version__


def samples(http) -> dict[str, float]:
    """Every sample of /metrics by name (label values dropped: one model, one finish reason summed)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_tokenize_and_detokenize_round_trip(http, tiny_tokenizer):
    text = "Hello, radix trees!"
    one = http.post("/tokenize", json={"prompt": text}).json()
    assert one["tokens"] == tiny_tokenizer.encode(text, add_special_tokens=True)
    assert one["count"] == len(one["tokens"]) and one["max_model_len"] == 1024
    many = http.post("/v1/tokenize", json={"prompt": [text, "b"], "add_special_tokens": False}).json()
    assert many["tokens"] == [tiny_tokenizer.encode(t, add_special_tokens=False) for t in (text, "b")]
    assert many["count"] == [len(t) for t in many["tokens"]]
    assert http.post("/detokenize", json={"tokens": many["tokens"][0]}).json() == {"text": text}
    assert http.post("/v1/detokenize", json={"tokens": many["tokens"]}).json() == {"text": [text, "b"]}


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
    ("/detokenize", {"tokens": [[1], [2, -1]]}, "tokens[1][1]"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_input_is_a_400(http, route, body, param):
    resp = http.post(route, json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param
    assert http.post("/tokenize", json={"prompt": "still serving"}).status_code == 200


def test_get_load_version_and_sglang_names(http):
    load = http.get("/get_load").json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert http.get("/version").json() == {"version": __version__}
    # SGLang's current names beside the older ones
    assert http.get("/server_info").json().keys() == http.get("/get_server_info").json().keys()
    assert http.get("/model_info").json() == http.get("/get_model_info").json()


def test_sglang_metric_names(http):
    before = samples(http)
    gen = {"text": "Once", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    assert http.post("/generate", json=gen).status_code == 200
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    structured = {"text": "JSON:", "sampling_params": {"max_new_tokens": 16, "json_schema": json.dumps(schema)}}
    assert http.post("/generate", json=structured).status_code == 200
    with http.stream("POST", "/generate", json={"text": "Long", "rid": "metrics-abort", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}) as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        assert http.post("/abort_request", json={"rid": "metrics-abort"}).status_code == 200
        for _ in lines:
            pass
    after = samples(http)

    def rise(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    for prefix in ("sglang", "arborlm"):
        assert rise(f"{prefix}:num_requests_total") == 3
        assert rise(f"{prefix}:num_aborted_requests_total") == 1
        assert rise(f"{prefix}:num_so_requests_total") == 1
        assert rise(f"{prefix}:time_per_output_token_seconds_count") == 3  # each made two tokens or more
        assert rise(f"{prefix}:time_to_first_token_seconds_count") == 3
        assert rise(f"{prefix}:generation_tokens_total") >= 4 + 2
        assert f"{prefix}:num_retracted_requests_total" in after
        assert rise(f"{prefix}:queue_time_seconds_count") == 3  # every request was admitted once
        assert f"{prefix}:num_queue_reqs" in after and f"{prefix}:token_usage" in after
    info = http.get("/get_server_info").json()
    assert after["sglang:num_retracted_requests_total"] == info["num_retractions"]


def aborted_counts(http) -> tuple[float, float]:
    """sglang:num_aborted_requests_total and sglang:num_requests_total{finish_reason="abort"}."""
    aborted = by_reason = 0.0
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "sglang:num_aborted_requests_total":
                aborted += sample.value
            elif sample.name == "sglang:num_requests_total" and sample.labels.get("finish_reason") == "abort":
                by_reason += sample.value
    return aborted, by_reason


@pytest.mark.parametrize(("route", "body"), [
    ("/generate", {"text": "Long", "stream": True, "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}),
    ("/v1/completions", {"model": "default", "prompt": "Long", "stream": True, "max_tokens": 500, "ignore_eos": True}),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "Long"}], "stream": True,
                              "max_tokens": 500, "ignore_eos": True}),
    ("/v1/responses", {"model": "default", "input": "Long", "stream": True, "max_output_tokens": 500}),
])
def test_a_dropped_stream_counts_as_one_abort(http, server, route, body):
    before = aborted_counts(http)
    with server.client() as dropping, dropping.stream("POST", route, json=body) as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data:"))
    # the client closed the connection; the server notices on its next write
    deadline = time.monotonic() + 20
    while aborted_counts(http)[0] == before[0] and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # a second count (the scheduler's own abort finish) would land by now
    after = aborted_counts(http)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
