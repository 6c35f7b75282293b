"""The scheduler alone: a `ScriptedWorker` instead of a model, real pools and radix cache.

Each request's tokens come from a fixed script, so the outputs are known in
advance; the worker also checks, every step, that each request's
`req_to_token` row points at KV of its own tokens and positions. Every run
checks the pool invariants after each step and that every KV slot and request
row is back in its pool at the end (`run_to_completion`).
"""

from __future__ import annotations

import random

import pytest

from arborlm.runtime.scheduler import NON_FINITE_MESSAGE, Scheduler
from tests.runtime.scheduler_helpers import (
    FAKE_EOS_ID,
    assert_idle_pools,
    create_fake_scheduler,
    make_req,
    run_to_completion,
)

SYSTEM = list(range(500, 540))  # a 40-token prefix some prompts share


def script(rid: str, length: int = 64) -> list[int]:
    """A request's fixed output tokens (never EOS), seeded by its id."""
    rng = random.Random(rid)
    return [rng.randrange(10, 1000) for _ in range(length)]


def prompt(i: int, shared: bool) -> list[int]:
    rng = random.Random(i)
    own = [rng.randrange(10, 1000) for _ in range(rng.randint(3, 30))]
    return SYSTEM + own if shared else own


SETTINGS = {
    "defaults": {},
    "chunked": {"chunked_prefill_size": 8, "max_prefill_tokens": 8},
    "no-radix-cache": {"disable_radix_cache": True},
    "no-mixed-chunk": {"enable_mixed_chunk": False},
    "fcfs": {"schedule_policy": "fcfs"},
    "dfs-weight": {"schedule_policy": "dfs-weight"},
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_outputs_follow_the_script(name):
    """Ragged prompts, some sharing a prefix, half arriving mid-decode: each request gets
    exactly its script up to max_new_tokens and reads only its own KV."""
    lengths = [5, 17, 1, 9, 24, 12]
    rids = [f"r{i}" for i in range(len(lengths))]
    sched = create_fake_scheduler({rid: script(rid) for rid in rids}, **SETTINGS[name])
    reqs = [make_req(rid, prompt(i, shared=i % 2 == 0), max_new_tokens=n, ignore_eos=True)
            for i, (rid, n) in enumerate(zip(rids, lengths))]
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    for req in reqs[:3]:
        sched.add_request(req)
    for _ in range(3):
        for out in sched.step():
            tokens[out.rid] += out.new_token_ids
    result = run_to_completion(sched, reqs[3:])
    for rid, toks in result.tokens.items():
        tokens[rid] += toks
    for rid, n in zip(rids, lengths):
        assert tokens[rid] == script(rid)[:n], rid
    assert sched.worker.kv_errors == []
    cached = sched.stats["num_cached_tokens"]
    if name == "no-radix-cache":
        assert cached == 0
    else:
        assert cached >= len(SYSTEM)  # the shared prefix was computed once, then matched


FINISHES = [
    # (sampling parameters, script, expected tokens, expected finish_reason)
    ({}, [10, 11, FAKE_EOS_ID, 12], [10, 11, FAKE_EOS_ID], {"type": "stop", "matched": FAKE_EOS_ID}),
    ({"ignore_eos": True, "max_new_tokens": 4}, [10, 11, FAKE_EOS_ID, 12, 13], [10, 11, FAKE_EOS_ID, 12],
     {"type": "length", "length": 4}),
    ({"stop_token_ids": [11]}, [10, 11, 12], [10, 11], {"type": "stop", "matched": 11}),
    ({"stop_token_ids": [11], "min_new_tokens": 3}, [10, 11, 12, 11, 13], [10, 11, 12, 11],
     {"type": "stop", "matched": 11}),
    # LetterTokenizer: 29 -> "d", 30 -> "e"; the stop string spans two tokens.
    ({"stop": ["de"]}, [10, 29, 30, 12], [10, 29, 30], {"type": "stop", "matched": "de"}),
    ({"max_new_tokens": 3}, [10, 11, 12, 13], [10, 11, 12], {"type": "length", "length": 3}),
    ({"max_new_tokens": 0}, [10], [], {"type": "length", "length": 0}),
]


@pytest.mark.parametrize("sampling, tokens, expected, finish", FINISHES)
def test_finish_conditions(sampling, tokens, expected, finish):
    sampling = {"max_new_tokens": 16, **sampling}
    sched = create_fake_scheduler({"s": tokens})
    result = run_to_completion(sched, [make_req("s", [5, 6, 7, 8], **sampling)])
    assert result.tokens.get("s", []) == expected
    assert result.finish["s"] == finish


@pytest.mark.parametrize("chunk", [-1, 8])
def test_retraction_under_a_tiny_pool_keeps_the_script(chunk):
    """A pool too small for all requests at once: the youngest are retracted, re-prefilled
    over prompt + output, and still produce their script over correct KV."""
    rids = [f"r{i}" for i in range(4)]
    sched = create_fake_scheduler(
        {rid: script(rid) for rid in rids}, max_total_tokens=100, chunked_prefill_size=chunk,
        init_new_token_ratio=0.05, min_new_token_ratio=0.0, new_token_ratio_decay=0.0,
    )
    reqs = [make_req(rid, prompt(i, shared=False) + [7] * 12, max_new_tokens=30, ignore_eos=True)
            for i, rid in enumerate(rids)]
    result = run_to_completion(sched, reqs)
    assert sched.stats["num_retractions"] > 0
    for rid in rids:
        assert result.tokens[rid] == script(rid)[:30], f"{rid} changed after retraction"
        assert result.finish[rid] == {"type": "length", "length": 30}
    assert sched.worker.kv_errors == []


def test_abort_of_running_and_waiting_frees_their_memory():
    sched = create_fake_scheduler({"a": script("a"), "b": script("b")}, max_running_requests=1)
    sched.add_request(make_req("a", prompt(0, shared=True), max_new_tokens=50, ignore_eos=True))
    sched.add_request(make_req("b", prompt(1, shared=True), max_new_tokens=50, ignore_eos=True))
    sched.step()
    sched.step()
    sched.abort_request("b")  # waiting (max_running_requests=1)
    sched.abort_request("a")  # running: aborted at the end of its next step
    finish = {}
    while sched.has_work():
        for out in sched.step():
            if out.finish_reason:
                finish[out.rid] = out.finish_reason["type"]
        sched.check_invariants()
    assert finish == {"a": "abort", "b": "abort"}
    assert_idle_pools(sched)


@pytest.mark.parametrize("failure", ["raises", "malformed"])
def test_worker_failure_aborts_only_its_step(failure):
    """A step whose worker raises (or returns too few tokens) aborts that step's requests
    and frees its slots; a request not in that step runs on to its script."""
    sched = create_fake_scheduler({rid: script(rid) for rid in "abc"}, max_running_requests=2)
    getattr(sched.worker, "fail_at" if failure == "raises" else "malformed_at").add(2)
    for rid in "abc":
        sched.add_request(make_req(rid, prompt(ord(rid), shared=False), max_new_tokens=6, ignore_eos=True))
    sched.step()  # prefill of a and b; c waits for a running slot
    outs = sched.step()  # the failing decode step
    assert sched.worker.step_rids[1] == ["a", "b"]
    assert {o.rid: o.finish_reason["type"] for o in outs} == {"a": "abort", "b": "abort"}
    assert all(o.finish_reason["message"].startswith("internal error") for o in outs)
    sched.check_invariants()
    result = run_to_completion(sched, [])
    assert result.tokens["c"] == script("c")[:6]
    assert result.finish["c"] == {"type": "length", "length": 6}


@pytest.mark.parametrize("step", [1, 3])
def test_a_non_finite_row_aborts_only_its_request(step):
    """A row the sampler flags as non-finite (NaN/inf logits: an underflowing temperature, a
    broken penalty) aborts that request alone, with a generic message and its memory back;
    the other requests of the same step go on to their scripts (issue: one request must not
    hurt the others)."""
    sched = create_fake_scheduler({rid: script(rid) for rid in "abc"})
    sched.worker.non_finite_at[step] = {"b"}
    reqs = [make_req(rid, prompt(ord(rid), shared=False), max_new_tokens=6, ignore_eos=True) for rid in "abc"]
    result = run_to_completion(sched, reqs)
    assert result.finish["b"]["type"] == "abort"
    assert result.finish["b"]["message"] == NON_FINITE_MESSAGE
    assert len(result.tokens["b"]) == step - 1  # nothing of the poisoned step reaches the client
    for rid in "ac":
        assert result.tokens[rid] == script(rid)[:6]
        assert result.finish[rid] == {"type": "length", "length": 6}
    assert sched.stats["num_non_finite_aborts"] == 1


def test_step_failure_message_hides_the_exception():
    sched = create_fake_scheduler({"a": script("a")})
    sched.worker.fail_at.add(1)
    result = run_to_completion(sched, [make_req("a", prompt(1, shared=False), max_new_tokens=4, ignore_eos=True)])
    assert result.finish["a"]["type"] == "abort"
    assert "injected" not in result.finish["a"]["message"]


def test_injected_worker_needs_a_tokenizer():
    sched = create_fake_scheduler({})
    with pytest.raises(ValueError, match="tokenizer"):
        Scheduler(sched.server_args, worker=sched.worker)
