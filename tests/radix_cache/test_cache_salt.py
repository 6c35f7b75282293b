"""`extra_key` (a tenant's cache_salt) namespaces radix-cache paths."""

import pytest
import torch

from tests.radix_cache.test_radix_cache import assert_all_slots_back, make_cache


def run_salted(cache, allocator, token_ids, salt):
    match = cache.match_prefix(token_ids, salt)
    cache.inc_lock_ref(match.last_node)
    prefix_len = len(match.device_indices)
    kv = torch.cat([match.device_indices, allocator.alloc(len(token_ids) - prefix_len)])
    cache.cache_finished_req(token_ids, kv, match.last_node, prefix_len, salt)
    cache.check_invariants()
    return prefix_len


@pytest.mark.parametrize("page_size", [1, 2])
def test_salts_never_share_prefixes(page_size):
    cache, allocator = make_cache(page_size=page_size)
    tokens = [1, 2, 3, 4, 5, 6]
    assert run_salted(cache, allocator, tokens, "a") == 0
    assert run_salted(cache, allocator, tokens, "b") == 0  # another tenant: no hit
    assert run_salted(cache, allocator, tokens, None) == 0  # nor the shared namespace
    assert len(cache.match_prefix(tokens[:4], "a").device_indices) == 4
    assert run_salted(cache, allocator, tokens[:4] + [9, 9], "a") == 4  # splits inside "a"
    assert len(cache.match_prefix(tokens, "b").device_indices) == 6
    assert cache.total_size() == 3 * 6 + 2
    cache.evict(cache.total_size())
    cache.check_invariants()
    assert_all_slots_back(cache, allocator)
