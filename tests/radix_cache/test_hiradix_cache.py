"""HiRadixCache: the host tier under the radix tree.

Each "request" writes K = its token id and V = its position into the device
slots it computes, so a prefix loaded back from the host tier can be checked
slot by slot against the tokens it stands for (a wrong copy, split or slot
mapping shows as a wrong K or V). Invariants of both tiers are checked after
every operation.
"""

from __future__ import annotations

import random

import pytest
import torch

from arborlm.radix_cache.hiradix_cache import HiRadixCache
from arborlm.radix_cache.host_pool import HostKVPool
from arborlm.radix_cache.memory_pool import TokenToKVPool, TokenToKVPoolAllocator


def make_hicache(device_size=16, host_size=32, page_size=1, storage_backend=None, dtype=torch.float32):
    allocator = TokenToKVPoolAllocator(device_size)
    kv_pool = TokenToKVPool(device_size, 2, 1, 4, dtype)
    host_pool = HostKVPool.for_device_pool(kv_pool, host_size, storage_backend)
    return HiRadixCache(allocator, kv_pool, host_pool, page_size=page_size)


def write_kv(cache: HiRadixCache, slots: torch.Tensor, tokens: list[int], start: int) -> None:
    """What a forward pass would store: K = token id, V = position, in every layer."""
    pool = cache.kv_pool
    for layer in range(pool.num_layers):
        k = torch.tensor(tokens, dtype=torch.float32).view(-1, 1, 1).expand(-1, 1, pool.head_dim)
        v = torch.arange(start, start + len(tokens), dtype=torch.float32).view(-1, 1, 1).expand(-1, 1, pool.head_dim)
        pool.set_kv_buffer(layer, slots, k + layer, v + layer)


def assert_kv(cache: HiRadixCache, slots: torch.Tensor, tokens: list[int]) -> None:
    pool = cache.kv_pool
    for layer in range(pool.num_layers):
        k, v = pool.read_kv(layer, slots, torch.float32)
        assert k[:, 0, 0].tolist() == [t + layer for t in tokens], "loaded-back K differs"
        assert v[:, 0, 0].tolist() == [p + layer for p in range(len(tokens))], "loaded-back V differs"


def run_req(cache: HiRadixCache, tokens: list[int], salt: str | None = None, load: bool = True) -> tuple[int, int]:
    """One request: match, load back, lock, compute the rest, cache it. Returns (device hit, host hit)."""
    allocator = cache.token_to_kv_pool_allocator
    match = cache.match_prefix(tokens, salt)
    device_hit, host_hit = len(match.device_indices), match.host_hit_length
    if load:
        match = cache.load_back(match)
        cache.check_invariants()
    prefix_len = len(match.device_indices)
    assert_kv(cache, match.device_indices, tokens[:prefix_len])
    cache.inc_lock_ref(match.last_node)
    short = len(tokens) - prefix_len - allocator.available_size()
    if short > 0:
        cache.evict(short)
    own = allocator.alloc(len(tokens) - prefix_len)
    assert own is not None
    write_kv(cache, own, tokens[prefix_len:], prefix_len)
    cache.cache_finished_req(tokens, torch.cat([match.device_indices, own]), match.last_node, prefix_len, salt)
    cache.check_invariants()
    return device_hit, host_hit


def assert_all_back(cache: HiRadixCache) -> None:
    cache.reset()
    cache.check_invariants()
    assert cache.token_to_kv_pool_allocator.available_size() == cache.token_to_kv_pool_allocator.size
    assert cache.host_pool.available_size() == cache.host_pool.size
    assert cache.host_size() == 0 and cache.total_size() == 0


def test_evicted_prefix_goes_to_host_and_loads_back_with_its_kv():
    cache = make_hicache(device_size=16, host_size=32)
    a, b = list(range(100, 112)), list(range(200, 212))
    assert run_req(cache, a) == (0, 0)
    assert run_req(cache, b) == (0, 0)  # a's 12 tokens do not fit beside b's: evicted to the host
    assert cache.host_size() >= 8 and cache.stats.num_backed_up_tokens == cache.host_size()
    match = cache.match_prefix(a)
    assert len(match.device_indices) + match.host_hit_length == 12 and match.host_hit_length > 0
    device_hit, host_hit = run_req(cache, a)
    assert device_hit + host_hit == 12 and host_hit > 0
    assert cache.stats.num_loaded_back_tokens == host_hit
    assert len(cache.match_prefix(a).device_indices) == 12  # all on the device again
    assert_all_back(cache)


def test_host_tier_full_evicts_its_own_lru_leaves():
    cache = make_hicache(device_size=8, host_size=12)
    prompts = [[base + i for i in range(8)] for base in (100, 200, 300, 400)]
    for tokens in prompts:
        run_req(cache, tokens)
    # 100.. went to the host first, then 200.., then 300..: the host holds 12, so 100.. was dropped.
    assert cache.stats.num_host_evicted_tokens >= 8
    assert cache.match_prefix(prompts[0]).host_hit_length == 0
    assert len(cache.match_prefix(prompts[0]).device_indices) == 0
    assert cache.match_prefix(prompts[2]).host_hit_length == 8  # the most recent evictee survives
    assert cache.host_size() <= 12
    assert_all_back(cache)


def test_a_host_tier_too_small_for_a_node_drops_it():
    cache = make_hicache(device_size=16, host_size=4)
    run_req(cache, list(range(100, 110)))
    run_req(cache, list(range(200, 216)))  # the 10-token node cannot go to a 4-token host tier
    assert cache.stats.num_dropped_tokens == 10
    assert cache.match_prefix(list(range(100, 110))).host_hit_length == 0
    assert_all_back(cache)


@pytest.mark.parametrize("page_size", [1, 2])
def test_cache_salt_namespaces_hold_across_tiers(page_size):
    cache = make_hicache(device_size=16, host_size=48, page_size=page_size)
    tokens = list(range(100, 112))
    run_req(cache, tokens, salt="a")
    run_req(cache, list(range(200, 216)))  # pushes tenant a's KV to the host tier
    assert cache.match_prefix(tokens, "a").host_hit_length == 12
    assert cache.match_prefix(tokens, "b").host_hit_length == 0
    assert cache.match_prefix(tokens).host_hit_length == 0
    assert run_req(cache, tokens, salt="b") == (0, 0)  # another tenant never reads a's host KV
    device_hit, host_hit = run_req(cache, tokens, salt="a")
    assert device_hit + host_hit == 12
    assert_all_back(cache)


def test_split_inside_a_host_node_loads_only_the_matched_part():
    cache = make_hicache(device_size=16, host_size=32)
    run_req(cache, list(range(100, 112)))
    run_req(cache, list(range(200, 216)))
    query = list(range(100, 106)) + [999, 998]
    match = cache.match_prefix(query)
    assert len(match.device_indices) + match.host_hit_length == 6
    assert run_req(cache, query)[0] + match.host_hit_length == 6
    assert cache.match_prefix(list(range(100, 112))).host_hit_length + len(
        cache.match_prefix(list(range(100, 112))).device_indices) == 12
    assert_all_back(cache)


def test_recomputing_a_host_prefix_adopts_the_fresh_slots():
    """A request that recomputes a host-tier prefix (no load-back) hands the tree its device slots."""
    cache = make_hicache(device_size=16, host_size=32)
    tokens = list(range(100, 112))
    run_req(cache, tokens)
    run_req(cache, list(range(200, 216)))
    assert run_req(cache, tokens, load=False)[1] > 0
    assert cache.stats.num_loaded_back_tokens == 0
    assert len(cache.match_prefix(tokens).device_indices) == 12  # the host copy gave way to the fresh one
    assert_all_back(cache)


def test_no_device_room_falls_back_to_recompute():
    cache = make_hicache(device_size=16, host_size=32)
    tokens = list(range(100, 112))
    run_req(cache, tokens)
    run_req(cache, list(range(200, 216)))
    held = cache.match_prefix(list(range(200, 216)))
    cache.inc_lock_ref(held.last_node)  # a running request pins the whole device pool
    match = cache.match_prefix(tokens)
    loaded = cache.load_back(match)
    assert loaded.host_hit_length == 0 and len(loaded.device_indices) == len(match.device_indices)
    assert cache.stats.num_load_back_failures == 1
    cache.check_invariants()
    cache.dec_lock_ref(held.last_node)
    assert_all_back(cache)


def test_a_failed_copy_mid_load_leaves_no_stale_slot(monkeypatch):
    """Two host nodes on the path; the second copy raises: the first stays loaded, the second
    stays in the host tier, the slots meant for it go back to the free list."""
    cache = make_hicache(device_size=16, host_size=32)
    run_req(cache, list(range(100, 112)))
    run_req(cache, list(range(100, 106)) + list(range(300, 306)))  # splits 100.. after 6 tokens
    run_req(cache, list(range(200, 216)))
    tokens = list(range(100, 112))
    match = cache.match_prefix(tokens)
    assert match.host_hit_length == 12 and len(match.device_indices) == 0
    real, calls = cache.host_pool.load_to_device, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected copy failure")
        return real(*args)

    monkeypatch.setattr(cache.host_pool, "load_to_device", flaky)
    free_before = cache.token_to_kv_pool_allocator.available_size() + cache.evictable_size()
    loaded = cache.load_back(match)
    cache.check_invariants()
    assert len(loaded.device_indices) == 6 and cache.stats.num_load_back_failures == 1
    assert_kv(cache, loaded.device_indices, tokens[:6])
    assert cache.match_prefix(tokens).host_hit_length == 6
    assert cache.token_to_kv_pool_allocator.available_size() + cache.evictable_size() == free_before
    monkeypatch.setattr(cache.host_pool, "load_to_device", real)
    assert run_req(cache, tokens) == (6, 6)
    assert_all_back(cache)


def test_reset_empties_both_tiers():
    cache = make_hicache(device_size=16, host_size=32)
    for base in (100, 200, 300):
        run_req(cache, [base + i for i in range(10)])
    assert cache.host_size() > 0 and cache.total_size() > 0
    assert_all_back(cache)
    assert cache.match_prefix(list(range(100, 110))).host_hit_length == 0


@pytest.mark.parametrize("page_size", [1, 2])
def test_random_workload_every_hit_reads_its_own_kv(page_size):
    """Shared system prompts, multi-turn continuations and salts over a small pool and host
    tier: every prefix hit (from either tier) reads exactly its tokens' K/V, invariants hold."""
    rng = random.Random(page_size)
    cache = make_hicache(device_size=40, host_size=60, page_size=page_size)
    systems = [[1000 * s + i for i in range(rng.randint(6, 14))] for s in range(5)]
    history: list[list[int]] = []
    host_hits = 0
    for _ in range(150):
        if history and rng.random() < 0.5:
            tokens = rng.choice(history) + [rng.randrange(1, 99) for _ in range(rng.randint(1, 6))]
        else:
            tokens = rng.choice(systems) + [rng.randrange(1, 99) for _ in range(rng.randint(1, 8))]
        tokens = tokens[:36]
        salt = rng.choice([None, None, "t"])
        host_hits += run_req(cache, tokens, salt)[1]
        history.append(tokens)
    assert host_hits > 0 and cache.stats.num_loaded_back_tokens == host_hits
    assert_all_back(cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("storage_backend", [None, "file"])
def test_host_pool_round_trip_is_bit_exact(dtype, storage_backend, tmp_path):
    device = TokenToKVPool(8, 2, 2, 4, dtype)
    host = HostKVPool(16, 2, 2, 4, dtype, storage_backend=storage_backend, file_dir=str(tmp_path))
    values = torch.randn(2, 9, 2, 4).clamp(-100, 100)
    values, doubled = values.to(dtype), (values * 2).to(dtype)
    device.k_buffer.copy_(values)
    device.v_buffer.copy_(doubled)
    host_slots = host.alloc(3)
    host.backup_from_device(device, torch.tensor([5, 1, 7]), host_slots)
    device.k_buffer.zero_()
    device.v_buffer.zero_()
    host.load_to_device(device, host_slots, torch.tensor([2, 3, 4]))
    for got, want in ((device.k_buffer, values), (device.v_buffer, doubled)):
        assert torch.equal(got[:, [2, 3, 4]].view(torch.uint8), want[:, [5, 1, 7]].view(torch.uint8))
    assert list(tmp_path.iterdir()) == []  # the mapped file is unlinked at once
    host.free(host_slots)
    host.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"size": 0}, "size"),
        ({"storage_backend": "mooncake"}, "storage_backend"),
    ],
)
def test_host_pool_refuses_bad_arguments(kwargs, error):
    args = dict(size=4, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32) | kwargs
    with pytest.raises(ValueError, match=error):
        HostKVPool(**args)
