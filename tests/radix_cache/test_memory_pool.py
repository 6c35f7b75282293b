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


class EagerFreeList:
    """The allocator's order as a plain list: take from the front, give back at the end."""

    def __init__(self, size: int):
        self.free = list(range(1, size + 1))

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        taken, self.free = self.free[:n], self.free[n:]
        return taken


@pytest.mark.parametrize("size", [300, 3000])  # 3000: hundreds of pieces queue before the list runs out
def test_allocator_hands_out_slots_in_free_list_order(size):
    """Freed slots queue behind the free list (joined only when an allocation reaches them,
    or in pieces past MAX_QUEUED_PIECES): every allocation still returns exactly the slots
    a free list joined at each free would, and a freed tensor changed afterwards does not
    change the free list."""
    gen = torch.Generator().manual_seed(5)
    allocator, eager = TokenToKVPoolAllocator(size), EagerFreeList(size)
    held: list[torch.Tensor] = []
    for step in range(2000):
        if held and (torch.rand((), generator=gen) < 0.5 or allocator.available_size() < 10):
            slots = held.pop(int(torch.randint(len(held), (), generator=gen)))
            allocator.free(slots)
            eager.free.extend(slots.tolist())
            slots.fill_(0)  # the caller's tensor, reused: the allocator kept its own copy
        else:
            n = int(torch.randint(1, 12, (), generator=gen))
            got, want = allocator.alloc(n), eager.alloc(n)
            assert (got is None) == (want is None)
            if got is not None:
                assert got.tolist() == want, f"step {step}"
                held.append(got.clone())
        assert allocator.available_size() == len(eager.free)
    assert allocator.free_slots.tolist() == eager.free
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
