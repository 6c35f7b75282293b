"""Tests of RadixCache: table-driven unit tests and a stateful property test.

The property test drives the cache the way the scheduler does (match, lock,
allocate the uncached rest, chunked prefill, decode, finish, evict) and checks
every step against a naive model: a dict from each cached token prefix to the
KV slot of its last token.
"""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from arborlm.radix_cache.memory_pool import TokenToKVPoolAllocator
from arborlm.radix_cache.radix_cache import MatchResult, RadixCache

POOL_SIZE = 64


def make_cache(page_size=1, disable=False, pool_size=POOL_SIZE):
    allocator = TokenToKVPoolAllocator(pool_size)
    return RadixCache(allocator, page_size=page_size, disable=disable), allocator


def run_req(cache, allocator, token_ids):
    """One request start to finish: match, lock, alloc the rest, cache it. Returns its slots."""
    match = cache.match_prefix(token_ids)
    cache.inc_lock_ref(match.last_node)
    prefix_len = len(match.device_indices)
    own = allocator.alloc(len(token_ids) - prefix_len)
    kv_indices = torch.cat([match.device_indices, own])
    cache.cache_finished_req(token_ids, kv_indices, match.last_node, prefix_len)
    cache.check_invariants()
    return kv_indices


def assert_all_slots_back(cache, allocator):
    cache.reset()
    assert allocator.available_size() == allocator.size
    allocator.check_invariants()


# --------------------------------------------------------------------- match


@pytest.mark.parametrize(
    ("inserted", "query", "matched_len"),
    [
        ([], [1, 2, 3], 0),
        ([[1, 2, 3]], [1, 2, 3], 3),
        ([[1, 2, 3]], [1, 2, 3, 4], 3),
        ([[1, 2, 3]], [1, 2], 2),
        ([[1, 2, 3]], [2, 1], 0),
        ([[1, 2, 3], [1, 2, 4, 5]], [1, 2, 4, 5, 6], 4),
        ([[1, 2, 3], [1, 2, 4, 5]], [1, 2, 7], 2),
        ([[1], [1, 2], [1, 2, 3]], [1, 2, 3], 3),
        ([[5, 6, 7, 8]], [], 0),
    ],
)
def test_match_after_insert(inserted, query, matched_len):
    cache, allocator = make_cache()
    slots = {}
    for token_ids in inserted:
        kv = run_req(cache, allocator, token_ids)
        for i in range(len(token_ids)):
            slots.setdefault(tuple(token_ids[: i + 1]), int(kv[i]))
    match = cache.match_prefix(query)
    assert isinstance(match, MatchResult)
    assert match.device_indices.dtype == torch.int64
    expected = [slots[tuple(query[: i + 1])] for i in range(matched_len)]
    assert match.device_indices.tolist() == expected
    if matched_len == 0:
        assert match.last_node is cache.root
    cache.check_invariants()
    assert_all_slots_back(cache, allocator)


def test_partial_match_splits_node():
    cache, allocator = make_cache()
    run_req(cache, allocator, [1, 2, 3, 4])
    assert len(cache.root.children) == 1
    match = cache.match_prefix([1, 2, 9])
    assert len(match.device_indices) == 2
    assert match.last_node.key == [1, 2]
    assert list(match.last_node.children.values())[0].key == [3, 4]
    assert cache.total_size() == 4
    cache.check_invariants()
    assert_all_slots_back(cache, allocator)


def test_split_keeps_lock_of_deeper_node():
    cache, allocator = make_cache()
    run_req(cache, allocator, [1, 2, 3, 4])
    deep = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(deep)
    cache.match_prefix([1, 2])  # splits `deep`'s edge while it is locked
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    cache.check_invariants()
    assert cache.evict(10) == 0
    cache.dec_lock_ref(deep)
    assert cache.evictable_size() == 4
    assert_all_slots_back(cache, allocator)


@pytest.mark.parametrize(
    ("first", "second", "already"),
    [
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2, 3, 4], 3),
        ([1, 2, 3], [1, 2, 4], 2),
        ([1, 2, 3], [4, 5], 0),
        ([1, 2, 3], [1], 1),
    ],
)
def test_insert_returns_already_present_len(first, second, already):
    cache, allocator = make_cache()
    first_slots = allocator.alloc(len(first))
    assert cache.insert(first, first_slots) == 0
    second_slots = allocator.alloc(len(second))
    assert cache.insert(second, second_slots) == already
    allocator.free(second_slots[:already])  # duplicates, as the caller would
    assert cache.total_size() == len(first) + len(second) - already
    cache.check_invariants()
    assert_all_slots_back(cache, allocator)


def test_duplicate_slots_freed_by_cache_finished_req():
    cache, allocator = make_cache()
    reqs = []
    for _ in range(2):  # two identical requests in flight, neither cached yet
        match = cache.match_prefix([7, 8, 9])
        cache.inc_lock_ref(match.last_node)
        reqs.append((allocator.alloc(3), match.last_node))
    for kv, last_node in reqs:
        cache.cache_finished_req([7, 8, 9], kv, last_node, 0)
        cache.check_invariants()
    assert cache.total_size() == 3
    assert allocator.available_size() == POOL_SIZE - 3
    assert cache.match_prefix([7, 8, 9]).device_indices.tolist() == reqs[0][0].tolist()
    assert_all_slots_back(cache, allocator)


def test_cache_unfinished_req_moves_lock_and_replaces_duplicates():
    cache, allocator = make_cache()
    winner = run_req(cache, allocator, [1, 2, 3])
    # a request that started before [1, 2, 3] was cached, so it has its own slots
    own = allocator.alloc(5)
    match = cache.cache_unfinished_req([1, 2, 3, 4, 5], own, cache.root, 0)
    assert match.device_indices.tolist() == winner.tolist() + own[3:].tolist()
    assert match.last_node.lock_ref == 1
    assert cache.protected_size() == 5 and cache.evictable_size() == 0
    assert allocator.available_size() == POOL_SIZE - 5
    cache.check_invariants()
    # more decode tokens, then finish
    more = allocator.alloc(2)
    kv = torch.cat([match.device_indices, more])
    cache.cache_finished_req([1, 2, 3, 4, 5, 6, 7], kv, match.last_node, 5)
    assert cache.protected_size() == 0 and cache.total_size() == 7
    cache.check_invariants()
    assert_all_slots_back(cache, allocator)


# --------------------------------------------------------------------- evict


def test_eviction_order_is_lru():
    cache, allocator = make_cache()
    run_req(cache, allocator, [1, 1])
    run_req(cache, allocator, [2, 2])
    run_req(cache, allocator, [3, 3])
    cache.match_prefix([1, 1])  # touch [1, 1]: now [2, 2] is the oldest
    assert cache.evict(1) == 2
    assert len(cache.match_prefix([2, 2]).device_indices) == 0
    assert len(cache.match_prefix([1, 1]).device_indices) == 2
    assert cache.evict(1) == 2  # [3, 3] is now the oldest
    assert len(cache.match_prefix([3, 3]).device_indices) == 0
    assert allocator.available_size() == POOL_SIZE - 2
    cache.check_invariants()
    assert_all_slots_back(cache, allocator)


def test_evict_parent_after_children():
    cache, allocator = make_cache()
    run_req(cache, allocator, [1, 2, 3])
    run_req(cache, allocator, [1, 2, 4])
    assert cache.total_size() == 4
    assert cache.evict(4) == 4
    assert cache.total_size() == 0 and not cache.root.children
    assert allocator.available_size() == POOL_SIZE
    cache.check_invariants()


@pytest.mark.parametrize("num_tokens", [1, 3, 100])
def test_locked_nodes_never_evicted(num_tokens):
    cache, allocator = make_cache()
    run_req(cache, allocator, [1, 2, 3])
    run_req(cache, allocator, [4, 5])
    locked = cache.match_prefix([1, 2, 3])
    assert cache.inc_lock_ref(locked.last_node) == -3
    freed = cache.evict(num_tokens)
    assert freed == 2
    assert cache.match_prefix([1, 2, 3]).device_indices.tolist() == locked.device_indices.tolist()
    assert cache.dec_lock_ref(locked.last_node) == 3
    cache.check_invariants()
    assert_all_slots_back(cache, allocator)


def test_lock_counts_nest():
    cache, allocator = make_cache()
    run_req(cache, allocator, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    assert cache.inc_lock_ref(node) == -2
    assert cache.inc_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == 0
    assert cache.protected_size() == 2
    assert cache.dec_lock_ref(node) == 2
    assert cache.evictable_size() == 2
    with pytest.raises(AssertionError):
        cache.dec_lock_ref(node)


def test_reset_refuses_locked_tree():
    cache, allocator = make_cache()
    run_req(cache, allocator, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(AssertionError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(node)
    assert_all_slots_back(cache, allocator)


# ----------------------------------------------------------------- page size


@pytest.mark.parametrize(
    ("token_ids", "cached_len"),
    [
        ([1, 2, 3], 0),
        ([1, 2, 3, 4], 4),
        ([1, 2, 3, 4, 5, 6], 4),
        (list(range(1, 10)), 8),
    ],
)
def test_page_size_4_truncates(token_ids, cached_len):
    cache, allocator = make_cache(page_size=4)
    kv = run_req(cache, allocator, token_ids)
    assert cache.total_size() == cached_len
    assert allocator.available_size() == POOL_SIZE - cached_len  # the tail was freed
    match = cache.match_prefix(token_ids + [99])
    assert match.device_indices.tolist() == kv[:cached_len].tolist()
    assert_all_slots_back(cache, allocator)


def test_page_size_4_matches_whole_pages_only():
    cache, allocator = make_cache(page_size=4)
    run_req(cache, allocator, [1, 2, 3, 4, 5, 6, 7, 8])
    assert len(cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 0]).device_indices) == 4
    assert len(cache.match_prefix([1, 2, 3, 0]).device_indices) == 0
    run_req(cache, allocator, [1, 2, 3, 4, 5, 6, 0, 0])
    assert cache.total_size() == 12
    assert sorted(
        len(c.key) for c in cache.match_prefix([1, 2, 3, 4]).last_node.children.values()
    ) == [4, 4]
    cache.check_invariants()
    assert_all_slots_back(cache, allocator)


# ------------------------------------------------------------------ disabled


def test_disabled_cache_holds_nothing():
    cache, allocator = make_cache(disable=True)
    kv = allocator.alloc(4)
    match = cache.match_prefix([1, 2, 3, 4])
    assert len(match.device_indices) == 0 and match.last_node is cache.root
    assert cache.insert([1, 2, 3, 4], kv) == 0
    unfinished = cache.cache_unfinished_req([1, 2, 3, 4], kv, cache.root, 0)
    assert unfinished.device_indices.tolist() == kv.tolist()
    assert unfinished.last_node is cache.root
    assert allocator.available_size() == POOL_SIZE - 4
    cache.cache_finished_req([1, 2, 3, 4], kv, cache.root, 0)
    assert allocator.available_size() == POOL_SIZE
    assert len(cache.match_prefix([1, 2, 3, 4]).device_indices) == 0
    assert cache.total_size() == 0 and cache.evict(10) == 0
    cache.check_invariants()
    allocator.check_invariants()


def test_pretty_print():
    cache, allocator = make_cache()
    run_req(cache, allocator, [1, 2, 3])
    run_req(cache, allocator, [1, 2, 4])
    text = cache.pretty_print()
    assert "[1, 2]" in text and "[3]" in text and "[4]" in text


# ------------------------------------------------------------ property tests

# Keys built from a few shared chunks (some not page-aligned) plus a random tail, so that
# requests share whole pages often enough for page_size 4 as well as 1.
CHUNKS = [[0, 1, 2, 3], [0, 1, 2, 0], [3, 3, 3, 3], [1, 0]]
tokens = st.builds(
    lambda chunks, tail: [t for chunk in chunks for t in chunk] + tail,
    st.lists(st.sampled_from(CHUNKS), max_size=3),
    st.lists(st.integers(0, 3), max_size=3),
)


class RadixCacheMachine(RuleBasedStateMachine):
    """Drive a RadixCache like a scheduler; compare with a naive prefix dict."""

    page_size = 1

    def __init__(self):
        super().__init__()
        self.cache, self.allocator = make_cache(page_size=self.page_size, pool_size=48)
        # whole-page token prefix -> slots of its last page (the naive model of the tree)
        self.cached: dict[tuple[int, ...], list[int]] = {}
        self.reqs: list[dict] = []  # running requests: token_ids, kv, last_node, prefix_len
        self.locks: list[tuple[list[int], MatchResult]] = []  # bare match + lock holders

    # naive model

    def pages(self, key):
        return [tuple(key[:end]) for end in range(self.page_size, len(key) + 1, self.page_size)]

    def naive_match(self, key):
        slots = []
        for prefix in self.pages(key):
            if prefix not in self.cached:
                break
            slots += self.cached[prefix]
        return slots

    def model_insert(self, token_ids, kv):
        for prefix in self.pages(token_ids):
            self.cached.setdefault(prefix, kv[len(prefix) - self.page_size : len(prefix)].tolist())

    def checked_match(self, key):
        match = self.cache.match_prefix(key)
        assert match.device_indices.tolist() == self.naive_match(key)
        return match

    def alloc(self, n):
        slots = self.allocator.alloc(n)
        if slots is None:
            self.do_evict(n - self.allocator.available_size())
            slots = self.allocator.alloc(n)
        return slots

    # rules

    @rule(key=tokens)
    def match(self, key):
        self.checked_match(key)

    @rule(key=tokens)
    def start_req(self, key):
        match = self.checked_match(key)
        self.cache.inc_lock_ref(match.last_node)
        prefix_len = len(match.device_indices)
        own = self.alloc(len(key) - prefix_len)
        if own is None:
            self.cache.dec_lock_ref(match.last_node)
            return
        kv = torch.cat([match.device_indices, own])
        self.reqs.append(
            dict(token_ids=list(key), kv=kv, last_node=match.last_node, prefix_len=prefix_len)
        )

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), new_tokens=tokens)
    def decode_req(self, data, new_tokens):
        req = self.reqs[data.draw(st.integers(0, len(self.reqs) - 1))]
        own = self.alloc(len(new_tokens))
        if own is None:
            return
        req["token_ids"] = req["token_ids"] + new_tokens
        req["kv"] = torch.cat([req["kv"], own])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def chunk_req(self, data):
        req = self.reqs[data.draw(st.integers(0, len(self.reqs) - 1))]
        args = (req["token_ids"], req["kv"], req["last_node"], req["prefix_len"])
        self.model_insert(req["token_ids"], req["kv"])
        match = self.cache.cache_unfinished_req(*args)
        assert match.device_indices.tolist() == self.naive_match(req["token_ids"])
        new_len = len(match.device_indices)
        req["kv"] = torch.cat([match.device_indices, req["kv"][new_len:]])
        req["last_node"], req["prefix_len"] = match.last_node, new_len

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish_req(self, data):
        req = self.reqs.pop(data.draw(st.integers(0, len(self.reqs) - 1)))
        self.model_insert(req["token_ids"], req["kv"])
        self.cache.cache_finished_req(
            req["token_ids"], req["kv"], req["last_node"], req["prefix_len"]
        )

    @rule(key=tokens)
    def lock(self, key):
        match = self.checked_match(key)
        self.cache.inc_lock_ref(match.last_node)
        self.locks.append((list(key), match))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        _, match = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.dec_lock_ref(match.last_node)

    @rule(num_tokens=st.integers(0, 20))
    def evict(self, num_tokens):
        self.do_evict(num_tokens)

    def do_evict(self, num_tokens):
        free_before = set(self.allocator.free_slots.tolist())
        evictable = self.cache.evictable_size()
        freed = self.cache.evict(num_tokens)
        gone = set(self.allocator.free_slots.tolist()) - free_before
        assert len(gone) == freed
        assert freed >= min(num_tokens, evictable)
        assert self.cache.evictable_size() == evictable - freed
        removed = {p for p, slots in self.cached.items() if gone.intersection(slots)}
        assert all(gone.issuperset(self.cached[p]) for p in removed), "part of a page evicted"
        for p in removed:
            del self.cached[p]
        assert len(gone) == len(removed) * self.page_size
        # only leaves go: what stays cached is still prefix-closed
        for p in self.cached:
            assert len(p) == self.page_size or p[: -self.page_size] in self.cached
        # locked prefixes survive
        for key, match in self.locks:
            locked = match.device_indices.tolist()
            assert self.naive_match(key)[: len(locked)] == locked
        for req in self.reqs:
            prefix = req["kv"][: req["prefix_len"]].tolist()
            assert self.naive_match(req["token_ids"])[: req["prefix_len"]] == prefix

    # invariants

    @invariant()
    def consistent(self):
        self.cache.check_invariants()
        self.allocator.check_invariants()
        assert self.cache.total_size() == len(self.cached) * self.page_size
        own = sum(len(r["kv"]) - r["prefix_len"] for r in self.reqs)
        held = self.allocator.available_size() + self.cache.total_size() + own
        assert held == self.allocator.size

    def teardown(self):
        for req in self.reqs:
            self.cache.cache_finished_req(
                req["token_ids"], req["kv"], req["last_node"], req["prefix_len"]
            )
        for _, match in self.locks:
            self.cache.dec_lock_ref(match.last_node)
        self.cache.check_invariants()
        assert self.cache.protected_size() == 0
        self.cache.reset()
        assert self.allocator.available_size() == self.allocator.size
        self.allocator.check_invariants()


class PagedRadixCacheMachine(RadixCacheMachine):
    page_size = 4


_settings = settings(
    max_examples=100,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixCacheMachine = RadixCacheMachine.TestCase
TestRadixCacheMachine.settings = _settings
TestPagedRadixCacheMachine = PagedRadixCacheMachine.TestCase
TestPagedRadixCacheMachine.settings = _settings
