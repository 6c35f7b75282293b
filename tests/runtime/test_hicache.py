"""The host KV tier in the scheduler (`--enable-hierarchical-cache`).

Multi-turn agents whose contexts together exceed the KV pool: with the host tier
their earlier turns come back from the host instead of being recomputed. The
scripted worker (K = token, V = position in every slot it writes, checked on
every read) catches any wrong slot a load-back could hand out; the tiny random
Llama checks that a prefix loaded back gives the tokens and logprobs of a fresh
computation. Pool invariants (free + cached + owned device slots, free + held
host slots) are checked after every step (`run_to_completion`).
"""

from __future__ import annotations

import random

import pytest
import torch

from arborlm.entrypoints.metrics import ServerMetrics
from arborlm.radix_cache.hiradix_cache import HiRadixCache
from arborlm.radix_cache.host_pool import HostSlotAllocator
from arborlm.radix_cache.memory_pool import TokenToKVPool
from arborlm.runtime.config import CacheConfig, ServerArgs
from arborlm.runtime.kv_manager import make_host_pool
from tests.runtime.scheduler_helpers import (
    create_fake_scheduler,
    create_scheduler,
    make_req,
    reference_greedy,
)

HICACHE = dict(enable_hierarchical_cache=True, hicache_ratio=4.0)


def agent_turns(num_agents: int, num_turns: int, seed: int = 0) -> tuple[list[list[list[int]]], dict[str, list[int]]]:
    """Prompts per round (each agent's next turn extends its whole history) and the
    scripted outputs of every request."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 1000) for _ in range(12)]
    histories = [system + [rng.randrange(3, 1000) for _ in range(20)] for _ in range(num_agents)]
    rounds, scripts = [], {}
    for turn in range(num_turns):
        prompts = []
        for a in range(num_agents):
            prompts.append(list(histories[a]))
            answer = [rng.randrange(3, 1000) for _ in range(6)]
            scripts[f"a{a}t{turn}"] = answer
            histories[a] += answer + [rng.randrange(3, 1000) for _ in range(8)]
        rounds.append(prompts)
    return rounds, scripts


def run_agents(sched, rounds, salt=None):
    tokens = {}
    for turn, prompts in enumerate(rounds):
        reqs = []
        for a, prompt in enumerate(prompts):
            req = make_req(f"a{a}t{turn}", prompt, max_new_tokens=6, ignore_eos=True)
            req.cache_salt = salt
            reqs.append(req)
        tokens.update(run_to_completion_keep_cache(sched, reqs).tokens)
    return tokens


def run_to_completion_keep_cache(sched, reqs):
    """`run_to_completion` without its final cache reset (the next round must find the cache)."""
    for req in reqs:
        sched.add_request(req)
    result = type("R", (), {"tokens": {}})()
    steps = 0
    while sched.has_work():
        steps += 1
        assert steps < 10_000
        for out in sched.step():
            result.tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        sched.check_invariants()
    return result


def test_agents_beyond_the_pool_load_their_history_back():
    rounds, scripts = agent_turns(num_agents=6, num_turns=4)
    runs = {}
    for name, extra in (("off", {}), ("on", HICACHE)):
        sched = create_fake_scheduler(scripts, max_total_tokens=160, chunked_prefill_size=64, **extra)
        tokens = run_agents(sched, rounds)
        assert sched.worker.kv_errors == []  # every position read its own token's K/V
        assert tokens == scripts
        runs[name] = sched.get_info()
        if name == "on":
            assert isinstance(sched.tree_cache, HiRadixCache)
            assert sched.flush_cache()
            sched.check_invariants()
            info = sched.get_info()
            assert info["hicache_host_used_tokens"] == 0 and info["cached_kv_tokens"] == 0
            assert info["free_kv_tokens"] == info["max_total_tokens"]
    on, off = runs["on"], runs["off"]
    assert on["num_host_cached_tokens"] > 0 and off["num_host_cached_tokens"] == 0
    assert on["hicache_loaded_back_tokens"] >= on["num_host_cached_tokens"]
    assert on["num_prefill_tokens_computed"] < off["num_prefill_tokens_computed"]
    assert on["cache_hit_rate"] > off["cache_hit_rate"]
    assert on["host_cache_hit_rate"] > 0
    assert on["device_cache_hit_rate"] + on["host_cache_hit_rate"] == pytest.approx(on["cache_hit_rate"])


def test_a_small_host_tier_evicts_its_own_lru_and_stays_correct():
    rounds, scripts = agent_turns(num_agents=6, num_turns=3, seed=1)
    sched = create_fake_scheduler(scripts, max_total_tokens=160, enable_hierarchical_cache=True, hicache_ratio=0.5)
    assert run_agents(sched, rounds) == scripts
    assert sched.worker.kv_errors == []
    info = sched.get_info()
    assert info["hicache_host_total_tokens"] == 80
    assert info["hicache_host_evicted_tokens"] > 0 and info["hicache_host_used_tokens"] <= 80


def test_cache_salt_keeps_tenants_apart_in_the_host_tier():
    """Tenant a's histories (mostly in the host tier by then) serve a's next turns, never b's
    requests for the same tokens: b's hits stay within what b's own requests share (the system prompt)."""
    rounds, scripts = agent_turns(num_agents=6, num_turns=2, seed=2)
    cached = {}
    for tenant in ("tenant-a", "tenant-b"):
        sched = create_fake_scheduler(scripts, max_total_tokens=160, **HICACHE)
        run_agents(sched, rounds[:1], salt="tenant-a")
        host_before = sched.get_info()["num_host_cached_tokens"]
        for a, prompt in enumerate(rounds[1]):
            req = make_req(f"a{a}t1", prompt, max_new_tokens=6, ignore_eos=True)
            req.cache_salt = tenant
            sched.add_request(req)
        while sched.has_work():
            for out in sched.step():
                cached[(tenant, out.rid)] = out.cached_tokens
            sched.check_invariants()
        assert sched.worker.kv_errors == []
        cached[tenant] = sched.get_info()["num_host_cached_tokens"] - host_before
    assert cached["tenant-a"] > 0  # a's history came back from the host tier
    assert all(cached[("tenant-a", f"a{a}t1")] >= 32 for a in range(6))
    assert all(cached[("tenant-b", f"a{a}t1")] <= 12 for a in range(6))


def test_an_abort_right_after_the_load_back_leaves_no_stale_slot():
    """The request is aborted while its (chunked) prefill runs over a prefix it just loaded
    back: its slots return, the loaded nodes stay valid, the next request reads them right."""
    rounds, scripts = agent_turns(num_agents=6, num_turns=2, seed=3)
    sched = create_fake_scheduler(scripts, max_total_tokens=160, chunked_prefill_size=8, **HICACHE)
    run_agents(sched, rounds[:1])
    victim = make_req("a0t1", rounds[1][0], max_new_tokens=6, ignore_eos=True)
    sched.add_request(victim)
    sched.step()  # admitted: the host part of its history is loaded back, the first chunk runs
    assert sched.get_info()["num_host_cached_tokens"] > 0
    sched.abort_request("a0t1")
    finish = None
    while sched.has_work():
        for out in sched.step():
            finish = out.finish_reason or finish
        sched.check_invariants()
    assert finish["type"] == "abort"
    assert sched.tree_cache.protected_size() == 0
    again = run_to_completion_keep_cache(sched, [make_req("a0t1", rounds[1][0], max_new_tokens=6, ignore_eos=True)])
    assert again.tokens["a0t1"] == scripts["a0t1"] and sched.worker.kv_errors == []


def test_reload_equals_recompute_on_the_tiny_llama(tiny_llama_dir, tiny_tokenizer, tiny_hf_model):
    """A prompt whose prefix went to the host tier and came back: greedy tokens equal a fresh
    computation's (and transformers'), and so do the top logprobs of every output token."""
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(90)]
    fillers = [[rng.randrange(100, 40000) for _ in range(90)] for _ in range(3)]
    prompt = prefix + [rng.randrange(100, 40000) for _ in range(10)]

    def ask(sched, rid, ids):
        req = make_req(rid, ids, max_new_tokens=8, ignore_eos=True)
        req.return_logprob, req.top_logprobs_num = True, 5
        sched.add_request(req)
        tokens, tops = [], []
        while sched.has_work():
            for out in sched.step():
                tokens += out.new_token_ids
                tops += out.output_top_logprobs
            sched.check_invariants()
        return tokens, tops

    sched = create_scheduler(tiny_llama_dir, tiny_tokenizer, max_total_tokens=200, **HICACHE)
    ask(sched, "first", prefix)
    for i, filler in enumerate(fillers):
        ask(sched, f"filler{i}", filler)
    assert sched.tree_cache.match_prefix(prompt).host_hit_length > 0
    tokens, tops = ask(sched, "again", prompt)
    assert sched.get_info()["num_host_cached_tokens"] >= 80
    fresh = create_scheduler(tiny_llama_dir, tiny_tokenizer, max_total_tokens=200, disable_radix_cache=True)
    want_tokens, want_tops = ask(fresh, "fresh", prompt)
    assert tokens == want_tokens == reference_greedy(tiny_hf_model, prompt, 8)
    for got, want in zip(tops, want_tops):
        assert [t for _, t in got] == [t for _, t in want]
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"enable_hierarchical_cache": True, "disable_radix_cache": True}, "enable_hierarchical_cache"),
        ({"hicache_ratio": 0.0}, "hicache_ratio"),
        ({"hicache_size": -1}, "hicache_size"),
        ({"hicache_storage_backend": "nixl"}, "hicache_storage_backend"),
    ],
)
def test_bad_hicache_arguments_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ServerArgs.from_kwargs(**kwargs)


def test_hicache_size_in_gb_sizes_the_host_tier():
    kv_pool = TokenToKVPool(8, 32, 8, 128, torch.float32)  # 256 KiB a token, K and V
    cache = CacheConfig(enable_hierarchical_cache=True, hicache_size=1, hicache_storage_backend="file")
    host = make_host_pool(cache, kv_pool)
    assert host.size == 10**9 // (2 * 32 * 8 * 128 * 4) and host.storage_backend == "file"
    assert make_host_pool(CacheConfig(enable_hierarchical_cache=True, hicache_ratio=2.5), kv_pool).size == 20
    assert make_host_pool(CacheConfig(), kv_pool) is None


def test_the_file_backend_serves_the_agents():
    rounds, scripts = agent_turns(num_agents=6, num_turns=3, seed=5)
    sched = create_fake_scheduler(scripts, max_total_tokens=160, hicache_storage_backend="file", **HICACHE)
    assert sched.tree_cache.host_pool.storage_backend == "file"
    assert run_agents(sched, rounds) == scripts and sched.worker.kv_errors == []
    assert sched.get_info()["num_host_cached_tokens"] > 0


def test_tier_hit_rates_reach_metrics():
    rounds, scripts = agent_turns(num_agents=6, num_turns=3, seed=4)
    sched = create_fake_scheduler(scripts, max_total_tokens=160, **HICACHE)
    run_agents(sched, rounds)
    info = sched.get_info()
    metrics = ServerMetrics("tiny")
    metrics.update_from_scheduler(info)
    text = metrics.render().decode()
    for prefix in ("arborlm", "sglang"):
        assert f'{prefix}:host_cache_hit_rate{{model_name="tiny"}} {info["host_cache_hit_rate"]}' in text
        assert f'{prefix}:device_cache_hit_rate{{model_name="tiny"}}' in text
        assert f'{prefix}:hicache_loaded_back_tokens_total{{model_name="tiny"}} ' \
               f'{float(info["hicache_loaded_back_tokens"])}' in text
    assert info["hicache_loaded_back_tokens"] > 0


@pytest.mark.parametrize(
    ("kwargs", "field", "room"),
    [
        ({"hicache_size": 100000}, "hicache_size", "host memory available"),
        ({"hicache_ratio": 1e12}, "hicache_ratio", "host memory available"),
        ({"hicache_size": 100000, "hicache_storage_backend": "file"}, "hicache_size", "free disk space"),
    ],
)
def test_a_host_tier_larger_than_the_machine_is_refused_by_name(kwargs, field, room):
    kv_pool = TokenToKVPool(8, 32, 8, 128, torch.float32)
    with pytest.raises(ValueError, match=f"{field}=.*{room}"):
        make_host_pool(CacheConfig(enable_hierarchical_cache=True, **kwargs), kv_pool)


def test_the_host_free_list_is_lazy():
    allocator = HostSlotAllocator(10**12)  # a free list of 8 TB if it were an array
    assert allocator.returned.numel() == 0 and allocator.available_size() == 10**12
    taken = allocator.alloc(3)
    assert taken.tolist() == [1, 2, 3] and allocator.available_size() == 10**12 - 3
    allocator.free(taken[1:2])
    assert allocator.alloc(2).tolist() == [2, 4]
    assert allocator.is_free(torch.tensor([1, 2, 3, 4, 5])).tolist() == [False, False, False, False, True]
    allocator.check_invariants()
