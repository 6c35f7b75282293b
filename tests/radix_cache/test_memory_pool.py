"""Tests of the KV memory pools: request rows, slot allocator, K/V buffers."""

import pytest
import torch

from arborlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator


@pytest.mark.parametrize("sizes", [[1], [3, 5], [8], [2, 2, 2, 2], [0, 4]])
def test_allocator_round_trip(sizes):
    allocator = TokenToKVPoolAllocator(8)
    taken = [allocator.alloc(n) for n in sizes]
    assert [len(t) for t in taken] == sizes
    assert allocator.available_size() == 8 - sum(sizes)
    flat = torch.cat(taken).tolist()
    assert len(set(flat)) == len(flat) and 0 not in flat
    assert all(t.dtype == torch.int64 for t in taken)
    for t in taken:
        allocator.free(t)
    assert allocator.available_size() == 8
    allocator.check_invariants()


def test_allocator_beyond_capacity_takes_nothing():
    allocator = TokenToKVPoolAllocator(4)
    first = allocator.alloc(3)
    assert allocator.alloc(2) is None
    assert allocator.available_size() == 1
    allocator.free(first)
    assert allocator.alloc(5) is None
    assert allocator.available_size() == 4
    allocator.check_invariants()


def test_allocator_double_free_caught():
    allocator = TokenToKVPoolAllocator(4)
    slots = allocator.alloc(2)
    allocator.free(slots)
    allocator.free(slots[:1])
    with pytest.raises(AssertionError, match="freed twice"):
        allocator.check_invariants()


def test_allocator_clear():
    allocator = TokenToKVPoolAllocator(4)
    allocator.alloc(4)
    allocator.clear()
    assert allocator.available_size() == 4
    allocator.check_invariants()


def test_req_to_token_pool_round_trip():
    pool = ReqToTokenPool(size=3, max_context_len=16)
    rows = pool.alloc(2)
    assert len(rows) == 2 and pool.available_size() == 1
    assert pool.alloc(2) is None and pool.available_size() == 1
    pool.free(rows)
    assert pool.available_size() == 3
    pool.check_invariants()
    pool.free(rows[0])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.check_invariants()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_buffer_round_trip(dtype):
    pool = TokenToKVPool(size=10, num_layers=2, num_kv_heads=2, head_dim=4, dtype=dtype)
    loc = torch.tensor([3, 7, 1], dtype=torch.int64)
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    pool.set_kv_buffer(1, loc, k, v)
    k_buf, v_buf = pool.get_kv_buffer(1)
    assert k_buf.shape == (11, 2, 4)
    torch.testing.assert_close(k_buf[loc], k.to(dtype))
    torch.testing.assert_close(v_buf[loc], v.to(dtype))
    assert not pool.get_kv_buffer(0)[0].any()
    assert TokenToKVPool.bytes_per_token(2, 2, 4, dtype) == 2 * 2 * 2 * 4 * k_buf.element_size()
