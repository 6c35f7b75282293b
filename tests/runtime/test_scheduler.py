"""Scheduler behaviour on the tiny random Llama, in-process (no zmq).

Every run checks the pool invariants after each step and that every KV slot and
request row returns to its pool at the end (`run_to_completion`).
"""

from __future__ import annotations

import random

import pytest
import torch

from arborlm.kernels import cpu_ops
from arborlm.runtime.scheduler import STEP_FAILED_MESSAGE
from tests.runtime.scheduler_helpers import (
    assert_idle_pools,
    create_scheduler,
    make_req,
    reference_greedy,
    run_to_completion,
)


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture
def make_scheduler(tiny_llama_dir, tiny_tokenizer):
    def make(**overrides):
        return create_scheduler(tiny_llama_dir, tiny_tokenizer, **overrides)

    return make


@pytest.mark.parametrize("disable_cpu_kernels", [False, True], ids=["cpu-kernels", "torch-ops"])
def test_continuous_batching_matches_reference(make_scheduler, tiny_hf_model, disable_cpu_kernels):
    """Ragged prompts with different lengths join and leave the batch; tokens equal greedy HF,
    with the fused C++ CPU kernels and with plain torch ops."""
    sched = make_scheduler(disable_cpu_kernels=disable_cpu_kernels)
    native_builds = cpu_ops.native_library() is not None  # no C++ compiler: torch ops either way
    assert sched.model_runner.model.ops.native is (native_builds and not disable_cpu_kernels)
    # the sampler and the speculative verifier follow the flag too
    assert sched.worker.sampler.native is sched.worker.draft_verifier.native is (not disable_cpu_kernels)
    ps = prompts(5, 3, 40)
    lengths = [4, 12, 7, 20, 9]
    reqs = [make_req(f"r{i}", p, max_new_tokens=n, ignore_eos=True) for i, (p, n) in enumerate(zip(ps, lengths))]
    result = run_to_completion(sched, reqs)
    for i, (p, n) in enumerate(zip(ps, lengths)):
        assert result.tokens[f"r{i}"] == reference_greedy(tiny_hf_model, p, n)
        assert result.finish[f"r{i}"] == {"type": "length", "length": n}


def test_requests_arriving_mid_decode_join_the_batch(make_scheduler, tiny_hf_model):
    sched = make_scheduler()
    first, second = prompts(2, 10, 20, seed=1)
    sched.add_request(make_req("a", first, max_new_tokens=15, ignore_eos=True))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(5):
        for out in sched.step():
            tokens[out.rid] += out.new_token_ids
    result = run_to_completion(sched, [make_req("b", second, max_new_tokens=8, ignore_eos=True)])
    for rid, toks in result.tokens.items():
        tokens[rid] += toks
    assert tokens["a"] == reference_greedy(tiny_hf_model, first, 15)
    assert tokens["b"] == reference_greedy(tiny_hf_model, second, 8)


def test_shared_prefix_is_served_from_cache_with_same_output(make_scheduler):
    system = prompts(1, 64, 64, seed=2)[0]
    questions = prompts(3, 5, 10, seed=3)
    reqs = lambda tag: [make_req(f"{tag}{i}", system + q, max_new_tokens=6, ignore_eos=True)  # noqa: E731
                        for i, q in enumerate(questions)]
    cold = make_scheduler(disable_radix_cache=True)
    cold_result = run_to_completion(cold, reqs("c"))
    warm = make_scheduler()
    run_to_completion(warm, [make_req("prime", system + [7], max_new_tokens=1)], check_every_step=False)
    warm.tree_cache.check_invariants()
    # run_to_completion resets the cache at the end; prime again and keep it.
    warm.add_request(make_req("prime2", system + [7], max_new_tokens=1))
    while warm.has_work():
        warm.step()
    warm_result = run_to_completion(warm, reqs("w"))
    for i in range(3):
        assert warm_result.tokens[f"w{i}"] == cold_result.tokens[f"c{i}"]
        assert warm_result.outputs[f"w{i}"][-1].cached_tokens >= len(system)
        assert cold_result.outputs[f"c{i}"][-1].cached_tokens == 0


def test_cached_tokens_never_exceed_prompt_minus_one(make_scheduler):
    sched = make_scheduler()
    p = prompts(1, 20, 20, seed=4)[0]
    sched.add_request(make_req("a", p, max_new_tokens=3, ignore_eos=True))
    while sched.has_work():
        sched.step()
    result = run_to_completion(sched, [make_req("b", p, max_new_tokens=3, ignore_eos=True)])
    assert result.outputs["b"][-1].cached_tokens == len(p) - 1


@pytest.mark.parametrize("chunk", [4, 7, 16])
def test_chunked_prefill_gives_same_tokens(make_scheduler, tiny_hf_model, chunk):
    sched = make_scheduler(chunked_prefill_size=chunk, max_prefill_tokens=chunk)
    ps = prompts(3, 20, 45, seed=5)
    result = run_to_completion(sched, [make_req(f"r{i}", p, max_new_tokens=5, ignore_eos=True) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert result.tokens[f"r{i}"] == reference_greedy(tiny_hf_model, p, 5)
    assert sched.stats["num_extend_steps"] >= sum(-(-len(p) // chunk) for p in ps) // 3


def test_retraction_under_kv_pressure_keeps_greedy_output(make_scheduler, tiny_hf_model):
    """A pool too small for all requests at once: the youngest are retracted and resume unchanged."""
    ps = prompts(4, 20, 30, seed=6)
    sched = make_scheduler(max_total_tokens=160, init_new_token_ratio=0.05, min_new_token_ratio=0.0,
                           new_token_ratio_decay=0.0)
    result = run_to_completion(sched, [make_req(f"r{i}", p, max_new_tokens=40, ignore_eos=True) for i, p in enumerate(ps)])
    assert sched.stats["num_retractions"] > 0
    for i, p in enumerate(ps):
        assert result.tokens[f"r{i}"] == reference_greedy(tiny_hf_model, p, 40), f"r{i} changed after retraction"


def test_huge_max_new_tokens_does_not_block_admission(make_scheduler):
    # The estimate is capped by the context (1024 tokens here), so 6 requests fit in 8192 slots.
    sched = make_scheduler(max_total_tokens=8192)
    for i, p in enumerate(prompts(6, 10, 10, seed=7)):
        sched.add_request(make_req(f"r{i}", p, max_new_tokens=1_000_000, ignore_eos=True))
    sched.step()  # one prefill step
    assert len(sched.running) == 6
    for i in range(6):
        sched.abort_request(f"r{i}")
    while sched.has_work():
        sched.step()
    assert_idle_pools(sched)


def test_stop_token_ids_and_eos(make_scheduler, tiny_hf_model):
    p = prompts(1, 10, 10, seed=8)[0]
    ref = reference_greedy(tiny_hf_model, p, 10)
    stop_at = ref[4]
    sched = make_scheduler()
    result = run_to_completion(sched, [make_req("s", p, max_new_tokens=10, stop_token_ids=[stop_at])])
    first = ref.index(stop_at)
    assert result.tokens["s"] == ref[: first + 1]
    assert result.finish["s"] == {"type": "stop", "matched": stop_at}


def test_min_new_tokens_defers_stop_token(make_scheduler, tiny_hf_model):
    p = prompts(1, 10, 10, seed=8)[0]
    ref = reference_greedy(tiny_hf_model, p, 10)
    first = ref.index(ref[4])
    sched = make_scheduler()
    result = run_to_completion(
        sched, [make_req("m", p, max_new_tokens=10, stop_token_ids=[ref[4]], min_new_tokens=first + 3)]
    )
    assert len(result.tokens["m"]) >= first + 3
    assert ref[4] not in result.tokens["m"][: first + 2]


def test_stop_string_spanning_tokens(make_scheduler, tiny_hf_model, tiny_tokenizer):
    p = prompts(1, 12, 12, seed=9)[0]
    ref = reference_greedy(tiny_hf_model, p, 12)
    text = tiny_tokenizer.decode(ref)
    # A stop string made of the end of token 5's text and the start of token 6's text.
    t5, t6 = tiny_tokenizer.decode(ref[:6]), tiny_tokenizer.decode(ref[:7])
    stop = t5[-2:] + t6[len(t5):][:2]
    assert stop in text
    sched = make_scheduler()
    result = run_to_completion(sched, [make_req("s", p, max_new_tokens=12, stop=[stop])])
    assert result.finish["s"] == {"type": "stop", "matched": stop}
    assert len(result.tokens["s"]) <= 7


def test_abort_running_and_waiting(make_scheduler):
    sched = make_scheduler(max_running_requests=1)
    a, b = prompts(2, 8, 8, seed=10)
    sched.add_request(make_req("a", a, max_new_tokens=50, ignore_eos=True))
    sched.add_request(make_req("b", b, max_new_tokens=50, ignore_eos=True))
    sched.step()
    sched.abort_request("b")  # waiting (max_running_requests=1)
    sched.abort_request("a")  # running
    finish = {}
    while sched.has_work():
        for out in sched.step():
            if out.finish_reason:
                finish[out.rid] = out.finish_reason["type"]
    assert finish == {"a": "abort", "b": "abort"}
    assert_idle_pools(sched)


def test_same_seed_same_tokens_alone_or_batched(make_scheduler):
    ps = prompts(3, 8, 12, seed=11)
    sampled = dict(temperature=1.0, top_p=0.9, max_new_tokens=10, ignore_eos=True)
    alone = run_to_completion(make_scheduler(), [make_req("x", ps[0], seed=123, **sampled)])
    batched = run_to_completion(
        make_scheduler(),
        [make_req("x", ps[0], seed=123, **sampled), make_req("y", ps[1], seed=5, **sampled),
         make_req("z", ps[2], seed=9, **sampled)],
    )
    assert alone.tokens["x"] == batched.tokens["x"]


def test_output_logprobs_match_reference(make_scheduler, tiny_hf_model):
    p = prompts(1, 10, 10, seed=12)[0]
    sched = make_scheduler()
    req = make_req("l", p, max_new_tokens=4, ignore_eos=True)
    req.return_logprob, req.top_logprobs_num, req.logprob_start_len = True, 3, 0
    result = run_to_completion(sched, [req])
    outs = result.outputs["l"]
    tokens = result.tokens["l"]
    with torch.inference_mode():
        logits = tiny_hf_model(torch.tensor([p + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    got = [lp for o in outs for lp in o.output_token_logprobs]
    for j, (lp, tid) in enumerate(got):
        assert tid == tokens[j]
        assert lp == pytest.approx(float(logprobs[len(p) - 1 + j, tid]), abs=1e-4)
    prompt_lps = outs[0].input_token_logprobs
    assert prompt_lps[0] == (None, p[0])
    for pos in range(1, len(p)):
        assert prompt_lps[pos][1] == p[pos]
        assert prompt_lps[pos][0] == pytest.approx(float(logprobs[pos - 1, p[pos]]), abs=1e-4)


def test_invalid_prompt_is_aborted_alone(make_scheduler):
    sched = make_scheduler()
    good = prompts(1, 5, 5, seed=13)[0]
    result = run_to_completion(sched, [make_req("empty", [], max_new_tokens=3), make_req("ok", good, max_new_tokens=3)])
    assert result.finish["empty"]["type"] == "abort"
    assert len(result.tokens["ok"]) == 3


def test_shared_prefix_in_one_batch_is_prefilled_once(make_scheduler):
    """Requests arriving together with a common uncached prefix compute it once."""
    system = prompts(1, 200, 200, seed=14)[0]
    questions = prompts(6, 5, 8, seed=15)
    sched = make_scheduler()
    reqs = [make_req(f"q{i}", system + q, max_new_tokens=3, ignore_eos=True) for i, q in enumerate(questions)]
    run_to_completion(sched, reqs)
    total_prompt = sum(len(system) + len(q) for q in questions)
    assert sched.stats["num_prefill_tokens_computed"] <= total_prompt - 5 * len(system) + 5
    cold = make_scheduler(disable_radix_cache=True)
    run_to_completion(cold, [make_req(f"c{i}", system + q, max_new_tokens=3, ignore_eos=True) for i, q in enumerate(questions)])
    assert cold.stats["num_prefill_tokens_computed"] == total_prompt


def test_cache_salt_keeps_tenants_apart(make_scheduler):
    p = prompts(1, 40, 40, seed=11)[0]
    sched = make_scheduler()

    def cached(rid, salt):
        req = make_req(rid, p, max_new_tokens=2, ignore_eos=True)
        req.cache_salt = salt
        sched.add_request(req)
        out = None
        while sched.has_work():
            for o in sched.step():
                out = o if o.finish_reason else out
        return out.cached_tokens

    assert cached("a1", "tenant-a") == 0
    assert cached("a2", "tenant-a") == len(p) - 1
    assert cached("b1", "tenant-b") == 0
    assert cached("n1", None) == 0
    assert cached("b2", "tenant-b") == len(p) - 1
    sched.check_invariants()


def test_failed_forward_aborts_its_batch_and_frees_its_slots(make_scheduler, monkeypatch):
    sched = make_scheduler()
    p = prompts(2, 10, 10, seed=12)
    for i, ids in enumerate(p):
        sched.add_request(make_req(f"f{i}", ids, max_new_tokens=20, ignore_eos=True))
    sched.step()  # prefill
    real_forward = sched.model_runner.forward

    def fail_once(batch):
        monkeypatch.setattr(sched.model_runner, "forward", real_forward)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(sched.model_runner, "forward", fail_once)
    outs = sched.step()
    assert sorted(o.finish_reason["type"] for o in outs) == ["abort", "abort"]
    # The client reads a generic message; the exception's text goes to the log only.
    assert outs[0].finish_reason["message"] == STEP_FAILED_MESSAGE
    assert "injected failure" not in outs[0].finish_reason["message"]
    assert_idle_pools(sched)
    sched.add_request(make_req("after", p[0], max_new_tokens=4, ignore_eos=True))
    while sched.has_work():
        sched.step()
    assert_idle_pools(sched)


def test_context_longer_than_the_model_is_refused(tiny_llama_dir, tiny_tokenizer):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        create_scheduler(tiny_llama_dir, tiny_tokenizer, context_length=4096)


def test_chunked_prefill_under_kv_pressure_never_aborts(make_scheduler, tiny_hf_model):
    """Prompts longer than the chunk while running requests fill the pool: the next chunk
    waits for room (or shrinks to it) instead of failing with "out of KV slots"."""
    ps = prompts(5, 50, 90, seed=11)
    sched = make_scheduler(max_total_tokens=230, chunked_prefill_size=16, max_prefill_tokens=16,
                           init_new_token_ratio=0.05, min_new_token_ratio=0.0, new_token_ratio_decay=0.0)
    result = run_to_completion(sched, [make_req(f"r{i}", p, max_new_tokens=30, ignore_eos=True) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert result.finish[f"r{i}"]["type"] == "length", result.finish[f"r{i}"]
        assert result.tokens[f"r{i}"] == reference_greedy(tiny_hf_model, p, 30)


@pytest.mark.parametrize("chunk", [-1, 16])
def test_mixed_chunk_decodes_running_requests_inside_prefill_steps(make_scheduler, tiny_hf_model, chunk):
    """Requests arriving while others decode: the running ones decode inside the prefill
    steps (no step where they wait), tokens still equal greedy HF, and pools drain."""
    ps = prompts(4, 20, 45, seed=11)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
    for enable in (True, False):
        sched = make_scheduler(enable_mixed_chunk=enable, chunked_prefill_size=chunk)
        sched.add_request(make_req("r0", ps[0], max_new_tokens=30, ignore_eos=True))
        for step in range(40):
            if step in (3, 6, 9):
                late = step // 3
                sched.add_request(make_req(f"r{late}", ps[late], max_new_tokens=12, ignore_eos=True))
            running = {r.rid: len(r.output_ids) for r in sched.running}
            for out in sched.step():
                tokens[out.rid] += out.new_token_ids
            sched.check_invariants()
            # Every request running before the step got exactly its next token in it, prefill or not.
            after = {r.rid: len(r.output_ids) for r in sched.alive_reqs() + sched.running}
            for rid, n in running.items():
                if enable and rid in after:
                    assert after[rid] == n + 1, f"{rid} waited in step {step}"
            if not sched.has_work():
                break
        assert_idle_pools(sched)
        for i, p in enumerate(ps):
            assert tokens[f"r{i}"] == reference_greedy(tiny_hf_model, p, 30 if i == 0 else 12)
        assert (sched.stats["num_mixed_steps"] > 0) == enable
        tokens = {rid: [] for rid in tokens}


def test_retracted_chunked_prompt_keeps_its_outputs_and_prompt_logprobs(make_scheduler, tiny_hf_model):
    """Chunks of a long prompt fill a tiny pool while another request decodes: the chunked
    prompt is retracted (it used to starve the decode step, which failed with "out of KV
    slots"), and on re-admission it scores its prompt logprobs once, not twice."""
    ps = [p + [7] * 12 for p in prompts(4, 5, 30, seed=17)]
    sched = make_scheduler(max_total_tokens=100, chunked_prefill_size=8, init_new_token_ratio=0.05,
                           min_new_token_ratio=0.0, new_token_ratio_decay=0.0)
    reqs = []
    for i, p in enumerate(ps):
        req = make_req(f"r{i}", p, max_new_tokens=30, ignore_eos=True)
        req.return_logprob, req.logprob_start_len = True, 0
        reqs.append(req)
    result = run_to_completion(sched, reqs)
    assert sched.stats["num_retractions"] > 0
    for i, p in enumerate(ps):
        assert result.finish[f"r{i}"] == {"type": "length", "length": 30}
        assert result.tokens[f"r{i}"] == reference_greedy(tiny_hf_model, p, 30)
        prompt_lps = [lp for o in result.outputs[f"r{i}"] for lp in o.input_token_logprobs or []]
        assert [tid for _, tid in prompt_lps] == p
        with torch.inference_mode():
            logprobs = torch.log_softmax(tiny_hf_model(torch.tensor([p])).logits[0].float(), dim=-1)
        for pos in range(1, len(p)):
            assert prompt_lps[pos][0] == pytest.approx(float(logprobs[pos - 1, p[pos]]), abs=1e-4)
