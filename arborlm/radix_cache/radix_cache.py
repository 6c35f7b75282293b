"""The radix-tree prefix cache: which token prefixes already have KV, and where.

Its one job is to remember the KV slots of token sequences the runtime has
already computed, so that a new request reuses the KV of its longest cached
prefix instead of recomputing it. In the request path (see DESIGN.md) the
scheduler calls `match_prefix(input_ids)` when it admits a request, allocates
slots for the uncached rest from `TokenToKVPoolAllocator`, calls
`cache_unfinished_req` after each prefill chunk and `cache_finished_req` when
the request ends; when the allocator runs dry it calls `evict`, which frees
unlocked leaves in least-recently-used order.

The tree follows RadixAttention in SGLang (Zheng et al. 2024, "SGLang: Efficient
Execution of Structured Language Model Programs", and `sglang/srt/mem_cache/
radix_cache.py`): each edge holds a run of token ids and the KV slots of those
tokens; children are keyed by their first token (by their first page when
`page_size > 1`); a node whose match ends inside it is split in two; a node is
locked (`lock_ref > 0`) while a running request reads it, and locking a node
locks its whole path to the root.

Sizes are counted in tokens. Slots are (n,) int64 CPU tensors, as the allocator
hands them out.
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple

import torch

from arborlm.radix_cache.memory_pool import TokenToKVPoolAllocator

ChildKey = int | tuple[int, ...]


def _empty_slots() -> torch.Tensor:
    return torch.empty((0,), dtype=torch.int64)


def _head(slots: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if slots is None else slots[:n]


def _tail(slots: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if slots is None else slots[n:]


class TreeNode:
    """One edge of the radix tree and the node below it.

    Attributes
    ----------
    children: child nodes keyed by their first token (first page tuple when paged).
    parent: the node above; None only for the root.
    key: token ids of this edge (empty only for the root).
    value: (len(key),) int64 KV slots of those tokens; None while the node's KV is
        only in the host tier (`HiRadixCache`).
    host_value: (len(key),) int64 host-tier slots of those tokens, or None (only
        `HiRadixCache` sets it; a node is in exactly one tier).
    lock_ref: how many running requests (or other holders) pin this node.
    last_access_time: a tick of the cache's monotonic clock, for LRU eviction.
    extra_key: the namespace of the path (a request's `cache_salt`); None for the
        shared one. Paths of different namespaces never share a node.
    """

    _ids = itertools.count()

    def __init__(
        self,
        key: list[int],
        value: torch.Tensor,
        parent: TreeNode | None,
        last_access_time: int,
        lock_ref: int = 0,
        extra_key: str | None = None,
    ):
        self.id = next(TreeNode._ids)
        self.extra_key = extra_key
        self.children: dict[ChildKey, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value: torch.Tensor | None = value
        self.host_value: torch.Tensor | None = None
        self.lock_ref = lock_ref
        self.last_access_time = last_access_time

    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    """The cached prefix of a key.

    Attributes
    ----------
    device_indices: (n,) int64 KV slots of the matched prefix, n = matched tokens.
    last_node: the deepest node matched on the device (the root when nothing matched).
    last_host_node: the deepest node matched in the host tier below `last_node`
        (`HiRadixCache`; None without a host hit).
    host_hit_length: tokens matched in the host tier past `device_indices` (SGLang's name).
    """

    device_indices: torch.Tensor
    last_node: TreeNode
    last_host_node: TreeNode | None = None
    host_hit_length: int = 0


class RadixCache:
    """Token-id radix tree whose nodes own KV slots.

    Parameters
    ----------
    token_to_kv_pool_allocator:
        Where evicted and duplicate slots are given back.
    page_size:
        Tokens per page. With `page_size > 1` only whole pages are cached and
        matched: keys are truncated to a multiple of `page_size`.
    disable:
        When True the cache holds nothing: every match is empty and every slot
        handed to `cache_finished_req` is freed.
    """

    def __init__(
        self,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
        disable: bool = False,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = disable
        self._clock = itertools.count()
        self.reset_tree()

    # ------------------------------------------------------------------ sizes

    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes (what `evict` could free)."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Tokens held by locked nodes."""
        return self._protected_size

    def total_size(self) -> int:
        """Tokens held by the whole tree."""
        return self._evictable_size + self._protected_size

    # ------------------------------------------------------------- lifecycle

    def reset_tree(self) -> None:
        """Forget the tree without freeing its slots (construction, tests)."""
        self.root = TreeNode([], _empty_slots(), None, self._tick(), lock_ref=1)
        self._evictable_size = 0
        self._protected_size = 0

    def reset(self) -> None:
        """Drop the whole tree and free every slot it holds through the allocator.

        Only legal when no node is locked: a locked node's slots are still read
        by a running request, so freeing them would hand live KV to someone else.

        Raises
        ------
        AssertionError
            When some node is still locked (`protected_size() > 0`).
        """
        assert self._protected_size == 0, f"reset with {self._protected_size} locked tokens"
        held = [node.value for node in self._nodes() if node is not self.root]
        if held:
            self.token_to_kv_pool_allocator.free(torch.cat(held))
        self.reset_tree()

    # ----------------------------------------------------------------- match

    def match_prefix(self, key: list[int], extra_key: str | None = None) -> MatchResult:
        """Find the longest cached prefix of `key`.

        Splits a node when the match ends inside it, so that the returned
        `last_node` covers exactly the matched tokens, and refreshes the LRU
        time of every node on the path. Locks nothing: the caller locks
        `last_node` with `inc_lock_ref` while it uses the slots.

        Parameters
        ----------
        key:
            Token ids. With `page_size > 1` it is truncated to whole pages.
        extra_key:
            Namespace (a tenant's `cache_salt`): only paths inserted with the
            same one match (SGLang's `RadixKey.extra_key`).

        Returns
        -------
        MatchResult
            Slots of the matched prefix, (n,) int64 with n in tokens, and the
            deepest matched node. A disabled cache returns no slots and the root.
        """
        if self.disable:
            return MatchResult(_empty_slots(), self.root)
        key = self._page_aligned(key)
        values, node = self._match(key, extra_key)
        indices = torch.cat(values) if values else _empty_slots()
        return MatchResult(indices, node)

    def _match(self, key: list[int], extra_key: str | None) -> tuple[list[torch.Tensor], TreeNode]:
        node, values = self.root, []
        now = self._tick()
        node.last_access_time = now
        while key:
            child = node.children.get(self._child_key(key, extra_key))
            if child is None:
                break
            child.last_access_time = now
            match_len = self._key_match_len(child.key, key)
            if match_len < len(child.key):
                node = self._split_node(child, match_len)
                values.append(node.value)
                break
            values.append(child.value)
            node, key = child, key[match_len:]
        return values, node

    # ---------------------------------------------------------------- insert

    def insert(self, key: list[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        """Insert `key` with its KV slots `value`.

        Parameters
        ----------
        key:
            Token ids. With `page_size > 1` only the whole-page part is inserted.
        value:
            (len(key),) integer KV slots of those tokens. The tree keeps a
            copy; slots of tokens that were already cached are not taken.

        Returns
        -------
        int
            Length in tokens of the prefix of `key` that was already in the
            tree (in namespace `extra_key`). The caller frees its own slots for those tokens (beyond the
            prefix it got from `match_prefix`) as duplicates.

        Raises
        ------
        AssertionError
            When `len(value) != len(key)`.
        """
        assert len(value) == len(key), f"{len(value)} slots for {len(key)} tokens"
        if self.disable:
            return 0
        key = self._page_aligned(key)
        value = value[: len(key)].to("cpu", torch.int64).clone()
        # Walking the tree refreshes the access time of the path and splits a partly matched edge.
        values, node = self._match(key, extra_key)
        prefix_len = sum(len(v) for v in values)
        if prefix_len < len(key):
            self._add_leaf(node, key[prefix_len:], value[prefix_len:], node.last_access_time, extra_key)
        return prefix_len

    def _add_leaf(
        self, parent: TreeNode, key: list[int], value: torch.Tensor, now: int, extra_key: str | None
    ) -> None:
        leaf = TreeNode(list(key), value, parent, now, extra_key=extra_key)
        parent.children[self._child_key(key, extra_key)] = leaf
        self._evictable_size += len(key)

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut `child`'s edge after `split_len` tokens; return the new upper node.

        `child` keeps its identity as the lower node, so locks held through it
        stay valid; the upper node inherits its lock count, which keeps the
        sizes unchanged.
        """
        upper = TreeNode(
            child.key[:split_len],
            _head(child.value, split_len),
            child.parent,
            child.last_access_time,
            lock_ref=child.lock_ref,
            extra_key=child.extra_key,
        )
        upper.host_value = _head(child.host_value, split_len)
        upper.children = {self._child_key(child.key[split_len:], child.extra_key): child}
        child.parent.children[self._child_key(upper.key, child.extra_key)] = upper
        child.parent = upper
        child.key = child.key[split_len:]
        child.value = _tail(child.value, split_len)
        child.host_value = _tail(child.host_value, split_len)
        return upper

    # ------------------------------------------------------------- requests

    def cache_finished_req(
        self,
        token_ids: list[int],
        kv_indices: torch.Tensor,
        last_node: TreeNode,
        prefix_len: int,
        extra_key: str | None = None,
    ) -> None:
        """Hand a finished request's KV to the tree and release its lock.

        Parameters
        ----------
        token_ids:
            All tokens of the request whose KV was computed (prompt + output).
        kv_indices:
            (len(token_ids),) integer slots of those tokens.
        last_node:
            The node the request locked after `match_prefix` (or the last
            `cache_unfinished_req`); unlocked here.
        prefix_len:
            How many leading slots of `kv_indices` came from the tree (tokens);
            they are owned by the tree and never freed here.
        extra_key:
            The request's namespace (`cache_salt`), as given to `match_prefix`.

        Notes
        -----
        Slots of tokens another request inserted meanwhile are freed as
        duplicates; with `page_size > 1` the slots of the last partial page are
        freed too. A disabled cache frees every slot (its `prefix_len` is 0).
        """
        assert len(kv_indices) == len(token_ids), (
            f"{len(kv_indices)} slots for {len(token_ids)} tokens"
        )
        allocator = self.token_to_kv_pool_allocator
        if self.disable:
            allocator.free(kv_indices[prefix_len:])
            return
        aligned_len = len(self._page_aligned(token_ids))
        new_prefix_len = self.insert(token_ids[:aligned_len], kv_indices[:aligned_len], extra_key)
        allocator.free(kv_indices[prefix_len:new_prefix_len])
        allocator.free(kv_indices[aligned_len:])
        self.dec_lock_ref(last_node)

    def cache_unfinished_req(
        self,
        token_ids: list[int],
        kv_indices: torch.Tensor,
        last_node: TreeNode,
        prefix_len: int,
        extra_key: str | None = None,
    ) -> MatchResult:
        """Insert what a running request has computed so far and move its lock.

        Parameters
        ----------
        token_ids, kv_indices, last_node, prefix_len, extra_key:
            As in `cache_finished_req`.

        Returns
        -------
        MatchResult
            The tree's slots for the whole-page part of `token_ids` and the new
            node the request now holds locked. The caller writes
            `device_indices` into its `req_to_token` row (duplicate slots were
            freed and replaced by the tree's) and uses their length as its new
            prefix length; slots past it (a partial last page) remain the
            request's own. A disabled cache frees nothing and returns the
            request's own slots with the root.
        """
        assert len(kv_indices) == len(token_ids), (
            f"{len(kv_indices)} slots for {len(token_ids)} tokens"
        )
        if self.disable:
            return MatchResult(kv_indices, self.root)
        aligned_len = len(self._page_aligned(token_ids))
        new_prefix_len = self.insert(token_ids[:aligned_len], kv_indices[:aligned_len], extra_key)
        self.token_to_kv_pool_allocator.free(kv_indices[prefix_len:new_prefix_len])
        match = self.match_prefix(token_ids[:aligned_len], extra_key)
        assert len(match.device_indices) == aligned_len
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(last_node)
        return match

    # ----------------------------------------------------------------- evict

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unlocked leaves, LRU first.

        A parent whose last child is evicted becomes a leaf candidate in turn.

        Parameters
        ----------
        num_tokens:
            Slots wanted, in tokens.

        Returns
        -------
        int
            Slots freed, in tokens: at least `num_tokens` unless fewer were
            evictable, possibly more (whole nodes are freed).
        """
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            self.token_to_kv_pool_allocator.free(node.value)
            freed += len(node.key)
            parent = self._delete_leaf(node)
            if parent is not self.root and parent.is_leaf() and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    def _evictable_leaves(self) -> list[TreeNode]:
        return [n for n in self._nodes() if n is not self.root and n.is_leaf() and n.lock_ref == 0]

    def _delete_leaf(self, node: TreeNode) -> TreeNode:
        parent = node.parent
        del parent.children[self._child_key(node.key, node.extra_key)]
        self._evictable_size -= len(node.key)
        return parent

    # ------------------------------------------------------------------ locks

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path from `node` up to the root.

        Parameters
        ----------
        node:
            Usually a `MatchResult.last_node`; the root locks nothing.

        Returns
        -------
        int
            Change in `evictable_size()`, in tokens (zero or negative).
        """
        if self.disable:
            return 0
        delta = 0
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Unlock the path from `node` up to the root (undo one `inc_lock_ref`).

        Parameters
        ----------
        node:
            The node given to the matching `inc_lock_ref`.

        Returns
        -------
        int
            Change in `evictable_size()`, in tokens (zero or positive).

        Raises
        ------
        AssertionError
            When a node on the path is not locked.
        """
        if self.disable:
            return 0
        delta = 0
        while node is not self.root:
            assert node.lock_ref > 0, f"dec_lock_ref on unlocked {node}"
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            node = node.parent
        return delta

    # ---------------------------------------------------------------- checks

    def check_invariants(self) -> None:
        """Assert the tree's internal consistency (tests call this).

        Checks that sizes add up, lock counts are >= 0 and never larger below
        than above, children are keyed by their first token (page), every
        edge is non-empty (whole pages when paged) with one slot per token,
        no slot is held twice, and no held slot is free in the allocator.
        """
        evictable = protected = 0
        slots: list[int] = []
        for node in self._nodes():
            for child_key, child in node.children.items():
                assert child.parent is node, f"{child} has a wrong parent"
                assert child_key == self._child_key(child.key, child.extra_key), f"{child} is under a wrong key"
            if node is self.root:
                continue
            assert node.key, f"{node} has an empty key"
            assert len(node.key) % self.page_size == 0, f"{node} is not whole pages"
            assert node.lock_ref >= 0, f"{node} has a negative lock_ref"
            if node.value is None:  # in the host tier only (HiRadixCache checks it)
                continue
            assert len(node.value) == len(node.key), f"{node}: value and key lengths differ"
            if node.parent is not self.root:
                assert node.lock_ref <= node.parent.lock_ref, f"{node} locked more than its parent"
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            slots.extend(node.value.tolist())
        assert evictable == self._evictable_size, f"evictable {evictable} != {self._evictable_size}"
        assert protected == self._protected_size, f"protected {protected} != {self._protected_size}"
        assert len(set(slots)) == len(slots), "a KV slot is held twice by the tree"
        assert 0 not in slots, "the padding slot 0 is in the tree"
        free = set(self.token_to_kv_pool_allocator.free_slots.tolist())
        assert not free.intersection(slots), "a slot held by the tree is also free"

    def pretty_print(self) -> str:
        """The tree as indented text, one node a line (debugging)."""
        lines: list[str] = []

        def visit(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                where = "host" if child.value is None else "slots"
                slots = child.host_value if child.value is None else child.value
                lines.append(
                    f"{'  ' * depth}{child.key} {where}={slots.tolist()} "
                    f"lock={child.lock_ref} t={child.last_access_time}"
                )
                visit(child, depth + 1)

        visit(self.root, 0)
        lines.append(f"#tokens: {self.total_size()} (evictable {self.evictable_size()})")
        return "\n".join(lines)

    # --------------------------------------------------------------- helpers

    def _nodes(self) -> list[TreeNode]:
        nodes, stack = [], [self.root]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def _tick(self) -> int:
        return next(self._clock)

    def _page_aligned(self, key: list[int]) -> list[int]:
        return list(key[: len(key) // self.page_size * self.page_size])

    def _child_key(self, key: list[int], extra_key: str | None = None) -> ChildKey:
        first = key[0] if self.page_size == 1 else tuple(key[: self.page_size])
        return first if extra_key is None else (extra_key, first)

    def _key_match_len(self, key0: list[int], key1: list[int]) -> int:
        """Common prefix length of two keys, in tokens (whole pages when paged)."""
        n = 0
        for a, b in zip(key0, key1):
            if a != b:
                break
            n += 1
        return n // self.page_size * self.page_size
