"""The serving benchmark's pure parts: workloads, request bodies, SSE parsing, metrics, the table.
No server and no model: tokens are counted as words."""

from __future__ import annotations

import math

import pytest

from benchmarks.serving.client import NotLoopbackError, StreamParser, build_payload, check_loopback
from benchmarks.serving.metrics import (
    SLO,
    RequestResult,
    percentile,
    server_cache_hit_rate,
    summarize,
)
from benchmarks.serving.report import markdown_table
from benchmarks.serving.workloads import (
    AGENT_STOP,
    JSON_SCHEMAS,
    WORKLOADS,
    Call,
    WorkloadSpec,
    iter_sessions,
)


def count_words(text: str) -> int:
    return len(text.split())


def render(messages) -> str:
    return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


def first_calls(spec: WorkloadSpec, n: int, seed: int = 0) -> list[Call]:
    sessions = iter_sessions(spec, count_words, seed)
    return [next(next(sessions).start()) for _ in range(n)]


def play(session, answer: str = "Thought: look it up") -> list[Call]:
    """Every call of a session, answering each with `answer`."""
    script = session.start()
    calls = [next(script)]
    while True:
        try:
            calls.append(script.send(answer))
        except StopIteration:
            return calls


@pytest.mark.parametrize("name", WORKLOADS)
def test_sessions_are_seeded(name):
    spec = WorkloadSpec(name)
    assert first_calls(spec, 3, seed=1) == first_calls(spec, 3, seed=1)
    assert first_calls(spec, 3, seed=1) != first_calls(spec, 3, seed=2)


def test_random_lengths_within_range():
    spec = WorkloadSpec("random", input_len=100, output_len=20, range_ratio=0.5)
    for call in first_calls(spec, 20):
        assert 10 <= call.max_tokens <= 20 and call.ignore_eos
        assert 45 <= count_words(call.messages[-1]["content"]) <= 105


def test_shared_prefix_groups_share_the_system_prompt():
    spec = WorkloadSpec("shared-prefix", num_groups=3, system_len=60, question_len=10)
    calls = first_calls(spec, 6)
    systems = [c.messages[0]["content"] for c in calls]
    assert len(set(systems)) == 3 and sorted(systems[:3]) == sorted(systems[3:])
    assert len({c.messages[1]["content"] for c in calls}) == 6


def test_multi_turn_history_holds_the_answers():
    spec = WorkloadSpec("multi-turn", num_turns=3)
    calls = play(next(iter_sessions(spec, count_words, 0)), answer="the answer")
    assert [len(c.messages) for c in calls] == [2, 4, 6]
    answer = {"role": "assistant", "content": "the answer"}
    assert calls[1].messages[:3] == calls[0].messages + (answer,)
    assert calls[2].messages[:5] == calls[1].messages + (answer,)


def test_agent_loop_appends_observations_and_stops_at_observation():
    spec = WorkloadSpec("agent", agent_steps=3, system_len=80)
    sessions = iter_sessions(spec, count_words, 0)
    one, two = next(sessions), next(sessions)
    calls = play(one)
    assert len(calls) == one.num_calls == 3
    assert all(c.stop == AGENT_STOP for c in calls)
    assert calls[1].messages[2]["role"] == "assistant" and calls[1].messages[3]["content"].startswith("Observation:")
    assert "Final Answer" in calls[2].messages[-1]["content"]
    assert next(two.start()).messages[0] == calls[0].messages[0]  # one system prompt for every client


def test_json_calls_rotate_schemas():
    calls = first_calls(WorkloadSpec("json"), 3)
    assert [c.json_schema for c in calls] == list(JSON_SCHEMAS)
    assert not any(c.ignore_eos for c in calls)


def test_spec_refuses_bad_values():
    with pytest.raises(ValueError, match="workload"):
        WorkloadSpec("nope")
    with pytest.raises(ValueError, match="output_len"):
        WorkloadSpec("random", output_len=0)


@pytest.mark.parametrize("url,ok", [
    ("http://127.0.0.1:30000", True), ("http://localhost:8000", True), ("http://[::1]:1", True),
    ("http://127.3.2.1", True), ("http://10.0.0.1:30000", False), ("http://example.com", False), ("x", False),
])
def test_loopback_only(url, ok):
    if ok:
        check_loopback(url)
    else:
        with pytest.raises(NotLoopbackError):
            check_loopback(url)


def test_payloads():
    call = Call(({"role": "user", "content": "hi"},), 8, ignore_eos=True, json_schema={"type": "object"},
                stop=("X",))
    chat = build_payload("chat", call, "m", render)
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["ignore_eos"]
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True} and chat["stop"] == ["X"]
    assert "ignore_eos" not in build_payload("chat", call, "m", render, ignore_eos=False)
    assert build_payload("completions", call, "m", render, extra_body={"seed": 1})["prompt"] == "<user>hi\n<assistant>"
    native = build_payload("generate", call, "m", render)
    assert native["text"] == "<user>hi\n<assistant>" and native["sampling_params"]["json_schema"] == '{"type": "object"}'
    assert native["sampling_params"]["max_new_tokens"] == 8 and native["sampling_params"]["ignore_eos"]


def test_stream_parser_chat_with_usage_and_llama_timings():
    parser = StreamParser("chat")
    assert parser.feed({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert parser.feed({"choices": [{"delta": {"content": "Hel"}}]}) == "Hel"
    assert parser.feed({"choices": [{"delta": {"content": "lo"}, "finish_reason": "length"}]}) == "lo"
    parser.feed({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                           "prompt_tokens_details": {"cached_tokens": 3}}})
    assert (parser.text, parser.finish_reason, parser.prompt_tokens, parser.completion_tokens,
            parser.cached_tokens) == ("Hello", "length", 5, 2, 3)
    llama = StreamParser("chat")
    llama.feed({"choices": [{"delta": {}, "finish_reason": "stop"}], "timings": {"cache_n": 7}})
    assert llama.cached_tokens == 7
    with pytest.raises(RuntimeError, match="boom"):
        StreamParser("completions").feed({"error": {"message": "boom"}})


def test_stream_parser_generate_is_cumulative():
    parser = StreamParser("generate")
    assert parser.feed({"text": "ab", "meta_info": {}}) == "ab"
    assert parser.feed({"text": "abc", "meta_info": {"prompt_tokens": 4, "completion_tokens": 3,
                                                     "cached_tokens": 1, "finish_reason": {"type": "stop"}}}) == "c"
    assert (parser.prompt_tokens, parser.completion_tokens, parser.cached_tokens, parser.finish_reason) == (4, 3, 1, "stop")


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert math.isnan(percentile([], 50))


def result(ttft, e2e, completion, ok=True, cached=None, prompt=10, itl=()):
    return RequestResult("random", ok, ttft_s=ttft, e2e_s=e2e, completion_tokens=completion, prompt_tokens=prompt,
                         cached_tokens=cached, itl_s=list(itl), error=None if ok else "HTTP 503: busy")


def test_summarize_throughput_latency_goodput():
    results = [result(0.1, 1.1, 11, cached=5, itl=[0.1] * 10), result(0.5, 2.5, 21, cached=0),
               result(None, None, 0, ok=False)]
    m = summarize(results, 2.0, SLO(ttft_s=0.2, tpot_s=0.2))
    assert (m["completed"], m["errors"], m["error_kinds"]) == (2, 1, {"HTTP 503: busy": 1})
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 16.0 and m["input_throughput"] == 10.0
    assert m["tpot_s"]["mean"] == pytest.approx(0.1)
    assert m["ttft_s"]["p50"] == pytest.approx(0.3) and m["itl_s"]["p99"] == pytest.approx(0.1)
    assert m["goodput"] == 0.5 and m["slo_attainment"] == pytest.approx(1 / 3)
    assert m["cache_hit_rate_client"] == 0.25
    assert summarize(results, 2.0)["goodput"] is None


def test_server_cache_hit_rate_from_counters():
    before = {"num_cached_tokens": 10, "num_prompt_tokens": 100}
    assert server_cache_hit_rate(before, {"num_cached_tokens": 70, "num_prompt_tokens": 200}) == 0.6
    assert server_cache_hit_rate(None, before) is None
    assert server_cache_hit_rate(before, before) is None


def test_markdown_table_row():
    m = summarize([result(0.1, 1.1, 11)], 1.0)
    record = {"label": "arborlm", "workload": "json", "concurrency": 8, "request_rate": None, "metrics": m,
              "cache_hit_rate_server": 0.5}
    table = markdown_table([record])
    lines = table.splitlines()
    assert len(lines) == 3 and lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    assert "| arborlm | json | c=8 |" in lines[2] and "| 50% |" in lines[2] and "| 0/1 |" in lines[2]


@pytest.mark.parametrize("argv,needle", [
    (["--concurrency", "-2"], "--concurrency: must be >= 1"),
    (["--concurrency", "4,0"], "--concurrency: must be >= 1"),
    (["--num-requests", "-3"], "--num-requests: must be >= 0"),
    (["--num-requests", "0", "--time-limit", "-1"], "--time-limit: must be > 0"),
    (["--request-rate", "0"], "--request-rate: must be > 0"),
    (["--request-rate", "2,-1"], "--request-rate: must be > 0"),
    (["--request-rate", "1", "--max-concurrency", "0"], "--max-concurrency: must be >= 1"),
    (["--warmup", "-1"], "--warmup: must be >= 0"),
    (["--base-url", "http://10.0.0.1:30000"], "is not a loopback address"),
])
def test_bad_arguments_stop_before_any_request(argv, needle, capsys):
    from benchmarks.bench_serving import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2 and needle in capsys.readouterr().err


def test_a_run_where_every_request_fails_exits_nonzero(tmp_path, capsys):
    """No server on the port: every request records a connection error, the record is
    still written, and the exit status and message say the server is not there."""
    import json
    import socket

    from benchmarks.bench_serving import main

    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "r.jsonl"
    code = main(["--base-url", f"http://127.0.0.1:{port}", "--num-requests", "2", "--warmup", "0",
                 "--model", "m", "--result-jsonl", str(out), "--disable-progress"])
    assert code == 1 and "is the server at" in capsys.readouterr().err
    metrics = json.loads(out.read_text())["metrics"]
    assert (metrics["completed"], metrics["errors"]) == (0, 2)
