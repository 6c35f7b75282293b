"""Schedule policies and the prefill adder on fake requests (no model)."""

from __future__ import annotations

import pytest
import torch

from arborlm.radix_cache.memory_pool import TokenToKVPoolAllocator
from arborlm.radix_cache.radix_cache import RadixCache
from arborlm.runtime.schedule_batch import Req
from arborlm.runtime.schedule_policy import PrefillAdder, SchedulePolicy
from arborlm.sampling_params import SamplingParams


def fake_req(rid: str, ids: list[int], max_new_tokens: int = 16) -> Req:
    return Req(rid=rid, origin_input_ids=ids, sampling_params=SamplingParams(max_new_tokens=max_new_tokens), seed=0)


@pytest.fixture
def tree():
    allocator = TokenToKVPoolAllocator(1000)
    cache = RadixCache(allocator)
    for key in ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9], [20, 21, 22]):
        value = allocator.alloc(len(key))
        cache.insert(key, value)
    return cache


def test_lpm_orders_by_longest_cached_prefix(tree):
    queue = [fake_req("none", [50, 51]), fake_req("short", [1, 2, 3, 9, 10]), fake_req("long", [1, 2, 3, 4, 5, 6, 7, 8, 0])]
    SchedulePolicy("lpm", tree).calc_priority(queue)
    assert [r.rid for r in queue] == ["long", "short", "none"]


def test_fcfs_keeps_arrival_order(tree):
    queue = [fake_req("a", [50]), fake_req("b", [1, 2, 3, 4, 5, 6, 7, 8]), fake_req("c", [20, 21])]
    SchedulePolicy("fcfs", tree).calc_priority(queue)
    assert [r.rid for r in queue] == ["a", "b", "c"]


def test_dfs_weight_groups_requests_sharing_a_subtree(tree):
    queue = [
        fake_req("x1", [20, 21, 22, 1]),
        fake_req("a1", [1, 2, 3, 4, 5, 6, 7, 8, 1]),
        fake_req("a2", [1, 2, 3, 4, 5, 6, 7, 8, 2]),
        fake_req("b1", [1, 2, 3, 9, 1]),
    ]
    SchedulePolicy("dfs-weight", tree).calc_priority(queue)
    order = [r.rid for r in queue]
    assert sorted(order) == ["a1", "a2", "b1", "x1"]
    # The heavier subtree ([1, 2, 3, ...] with three requests) comes first and stays together.
    assert order[-1] == "x1"
    assert abs(order.index("a1") - order.index("a2")) == 1


@pytest.mark.parametrize(
    "rem_total, rem_input, chunk, lens, admitted, chunked",
    [
        (1000, 1000, None, [10, 10, 10], 3, None),  # everything fits
        (1000, 15, None, [10, 10], 1, None),  # prefill budget stops the second
        (1000, 5, None, [10], 1, None),  # the first request is always admitted whole
        (1000, 1000, 8, [5, 10], 2, 1),  # the second is chunked to the remaining 3 tokens
        (1000, 1000, 8, [20], 1, 0),  # a long prompt is chunked
        (30, 1000, None, [10, 10, 10], 2, None),  # KV budget with future-token reservation
    ],
)
def test_prefill_adder_budgets(rem_total, rem_input, chunk, lens, admitted, chunked):
    adder = PrefillAdder(rem_total, rem_input, chunk, new_token_ratio=0.25)
    reqs = [fake_req(f"r{i}", list(range(n)), max_new_tokens=16) for i, n in enumerate(lens)]
    for req in reqs:
        if adder.new_chunked_req is not None or not adder.add_one_req(req, 0, nothing_running=True):
            break
    assert len(adder.can_run_list) == admitted
    assert adder.new_chunked_req is (None if chunked is None else reqs[chunked])
    if chunk is not None:
        assert sum(r.extend_input_len for r in adder.can_run_list) <= chunk


def test_reservation_counts_running_requests():
    running = [fake_req("run", [1] * 4, max_new_tokens=100)]
    running[0].output_ids = [1] * 20
    adder = PrefillAdder(100, 1000, None, new_token_ratio=0.5)
    adder.reserve_running(running)
    assert adder.rem_total_tokens == 100 - 40
    assert not adder.add_one_req(fake_req("big", [1] * 61, max_new_tokens=0), 0, nothing_running=False)
    assert adder.add_one_req(fake_req("small", [1] * 50, max_new_tokens=0), 0, nothing_running=False)


def test_match_prefix_slots_are_the_inserted_ones(tree):
    match = tree.match_prefix([1, 2, 3, 9, 99])
    assert len(match.device_indices) == 4
    assert match.device_indices.dtype == torch.int64


def test_requests_sharing_an_uncached_prefix_wait_for_the_first(tree):
    shared = list(range(100, 140))
    queue = [fake_req("a", shared + [1]), fake_req("b", shared + [2]), fake_req("c", [7] * 40), fake_req("d", shared + [3])]
    policy = SchedulePolicy("lpm", tree)
    policy.calc_priority(queue)
    assert policy.deprioritized == {"b", "d"}
