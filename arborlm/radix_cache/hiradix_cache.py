"""The hierarchical radix cache: a device tier and a host tier under one radix tree.

With `--enable-hierarchical-cache` the KV manager uses this cache instead of
`RadixCache`. Its one job beyond the radix tree is to move node KV between the
device pool and a `HostKVPool`, as SGLang's HiCache does (`sglang/srt/mem_cache/
hiradix_cache.py`; Xie et al., "Strata: Hierarchical Context Caching", 2025):

- `evict` (the device pool ran short) copies each LRU device leaf into the
  host tier and frees its device slots; the node stays in the tree with
  `value = None` and `host_value` set ("write back": a node is copied when it
  leaves the device, never before, so a node is in exactly one tier);
- the host tier, when full, evicts its own least-recently-used leaves, and
  those leave the tree; a node the host tier cannot take is dropped;
- `match_prefix` walks through both tiers: `device_indices` and `last_node`
  cover the device part, `last_host_node` and `host_hit_length` the host part
  below it (device nodes form a top part of every path: a node is evicted to
  the host only when no child of it is on the device);
- `load_back` copies a matched host part into freshly allocated device slots
  (evicting other device leaves to the host if needed), so the request
  extends from the end of the whole hit instead of recomputing it. When the
  device cannot make room, or a copy fails, the request recomputes the rest.

Sizes (`evictable_size`, `protected_size`, `total_size`) count device tokens, as
in `RadixCache`; `host_size` counts host-tier tokens. Locks only ever hold
device nodes. Everything runs synchronously inside the scheduler's step, so no
request can see a half-loaded node.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import asdict, dataclass

import torch

from arborlm.radix_cache.host_pool import HostKVPool
from arborlm.radix_cache.memory_pool import TokenToKVPool, TokenToKVPoolAllocator
from arborlm.radix_cache.radix_cache import MatchResult, RadixCache, TreeNode, _empty_slots

logger = logging.getLogger(__name__)


@dataclass
class HiCacheStats:
    """Running totals of tier traffic, in tokens."""

    num_backed_up_tokens: int = 0  # copied device -> host on eviction
    num_loaded_back_tokens: int = 0  # copied host -> device on a prefix hit
    num_host_evicted_tokens: int = 0  # dropped by the host tier's own LRU eviction
    num_dropped_tokens: int = 0  # evicted from the device with no host room for them
    num_load_back_failures: int = 0  # load-backs that found no device room or failed to copy


class HiRadixCache(RadixCache):
    """`RadixCache` whose evicted nodes live on in a host tier and load back on a hit.

    Parameters
    ----------
    token_to_kv_pool_allocator: the device slot allocator.
    kv_pool: the device K/V buffers nodes are copied out of and back into.
    host_pool: the host tier.
    page_size: as in `RadixCache`.
    """

    def __init__(
        self,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        kv_pool: TokenToKVPool,
        host_pool: HostKVPool,
        page_size: int = 1,
    ):
        self.kv_pool = kv_pool
        self.host_pool = host_pool
        self.stats = HiCacheStats()
        # The deepest node of a host path being loaded back: the host tier's eviction spares it.
        self._loading: TreeNode | None = None
        super().__init__(token_to_kv_pool_allocator, page_size=page_size)

    # ------------------------------------------------------------------ sizes

    def host_size(self) -> int:
        """Tokens held in the host tier."""
        return self._host_size

    def reset_tree(self) -> None:
        """Forget the tree without freeing its slots (construction, tests)."""
        self._host_size = 0
        super().reset_tree()

    def reset(self) -> None:
        """Drop the whole tree: free every device slot and every host slot it holds.

        Raises
        ------
        AssertionError
            When some node is still locked.
        """
        assert self._protected_size == 0, f"reset with {self._protected_size} locked tokens"
        for node in self._nodes():
            if node is self.root:
                continue
            if node.value is not None:
                self.token_to_kv_pool_allocator.free(node.value)
            if node.host_value is not None:
                self.host_pool.free(node.host_value)
        self.reset_tree()

    # ----------------------------------------------------------------- match

    def match_prefix(self, key: list[int], extra_key: str | None = None) -> MatchResult:
        """Find the longest cached prefix of `key` across both tiers.

        As `RadixCache.match_prefix`; besides, `last_host_node` and
        `host_hit_length` say how far the match goes on in the host tier.
        Nothing is loaded: the scheduler calls `load_back` for a request it admits.
        """
        key = self._page_aligned(key)
        node, now = self.root, self._tick()
        node.last_access_time = now
        device_values: list[torch.Tensor] = []
        last_device, host_len = self.root, 0
        while key:
            child = node.children.get(self._child_key(key, extra_key))
            if child is None:
                break
            child.last_access_time = now
            match_len = self._key_match_len(child.key, key)
            if match_len < len(child.key):
                child = self._split_node(child, match_len)
            if child.value is not None:
                device_values.append(child.value)
                last_device = child
            else:
                host_len += len(child.key)
            node, key = child, key[match_len:]  # after a split the next lookup misses
        indices = torch.cat(device_values) if device_values else _empty_slots()
        if host_len == 0:
            return MatchResult(indices, last_device)
        return MatchResult(indices, last_device, last_host_node=node, host_hit_length=host_len)

    def load_back(self, match: MatchResult) -> MatchResult:
        """Copy the host part of `match` into the device pool; return the match it became.

        Device slots for `host_hit_length` tokens are allocated (evicting other
        unlocked device leaves to the host tier when short; the matched device
        part is locked meanwhile and the host path is spared by the host tier's
        eviction), the host K/V copied into them node by node from the top, and
        those nodes' host slots freed. When the device cannot make room, the
        device part alone is returned; when a copy fails, the nodes already
        loaded are kept and the rest stays in the host tier (the request then
        recomputes it, which gives the same KV).

        Parameters
        ----------
        match: a fresh result of `match_prefix` (no insert or evict since).

        Returns
        -------
        MatchResult
            Device slots of the whole loaded prefix and its deepest node, with no host part.
        """
        if match.host_hit_length == 0:
            return match
        path = self._host_path(match)
        self.inc_lock_ref(match.last_node)
        self._loading = match.last_host_node
        try:
            short = match.host_hit_length - self.token_to_kv_pool_allocator.available_size()
            if short > 0:
                self.evict(short)
            slots = self.token_to_kv_pool_allocator.alloc(match.host_hit_length)
        finally:
            self._loading = None
            self.dec_lock_ref(match.last_node)
        if slots is None:
            self.stats.num_load_back_failures += 1
            return MatchResult(match.device_indices, match.last_node)
        return self._copy_path_back(match, path, slots)

    def _host_path(self, match: MatchResult) -> list[TreeNode]:
        """The host nodes from just below `match.last_node` down to `match.last_host_node`."""
        path, node = [], match.last_host_node
        while node is not match.last_node:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def _copy_path_back(self, match: MatchResult, path: list[TreeNode], slots: torch.Tensor) -> MatchResult:
        values, last, offset = [match.device_indices], match.last_node, 0
        try:
            for node in path:
                device_slots = slots[offset : offset + len(node.key)]
                self.host_pool.load_to_device(self.kv_pool, node.host_value, device_slots)
                self._to_device(node, device_slots)
                values.append(device_slots)
                last, offset = node, offset + len(node.key)
        except Exception:  # noqa: BLE001 - a failed copy costs a recompute, never the step
            logger.exception("host-tier load-back failed after %d of %d tokens", offset, len(slots))
            self.stats.num_load_back_failures += 1
        finally:
            self.token_to_kv_pool_allocator.free(slots[offset:])
        self.stats.num_loaded_back_tokens += offset
        return MatchResult(torch.cat(values), last)

    def _to_device(self, node: TreeNode, device_slots: torch.Tensor) -> None:
        """Make `node` a device node over `device_slots` and give its host slots back."""
        self.host_pool.free(node.host_value)
        node.value, node.host_value = device_slots.clone(), None
        self._host_size -= len(node.key)
        self._evictable_size += len(node.key)

    # ---------------------------------------------------------------- insert

    def insert(self, key: list[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        """Insert `key` with its device slots `value`, as `RadixCache.insert`.

        A host-only node on the path takes the caller's fresh device slots for
        its tokens (the caller recomputed them) and gives its host slots back.

        Returns
        -------
        int
            Tokens of `key` whose device slots the tree already held (the
            caller frees its own for those as duplicates).
        """
        assert len(value) == len(key), f"{len(value)} slots for {len(key)} tokens"
        key = self._page_aligned(key)
        value = value[: len(key)].to("cpu", torch.int64).clone()
        node, now = self.root, self._tick()
        node.last_access_time = now
        pos = prefix_len = 0
        while pos < len(key):
            child = node.children.get(self._child_key(key[pos:], extra_key))
            if child is None:
                break
            child.last_access_time = now
            match_len = self._key_match_len(child.key, key[pos:])
            if match_len < len(child.key):
                child = self._split_node(child, match_len)
            if child.value is None:
                self._to_device(child, value[pos : pos + match_len])
            else:
                assert prefix_len == pos, "a device node below a host-only node"
                prefix_len = pos + match_len
            node, pos = child, pos + match_len
        if pos < len(key):
            self._add_leaf(node, key[pos:], value[pos:], now, extra_key)
        return prefix_len

    # ----------------------------------------------------------------- evict

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots, LRU device leaves first, keeping their KV
        in the host tier (the host evicts its own LRU leaves to make room).

        Returns
        -------
        int
            Device slots freed, in tokens.
        """
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += len(node.key)
            if not self._write_back(node):
                self._drop_subtree(node)
            if parent is not self.root and self._is_device_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    def _evictable_leaves(self) -> list[TreeNode]:
        return [n for n in self._nodes() if n is not self.root and self._is_device_leaf(n)]

    def _is_device_leaf(self, node: TreeNode) -> bool:
        """Unlocked, on the device, and no child on the device."""
        return (node.value is not None and node.lock_ref == 0
                and all(c.value is None for c in node.children.values()))

    def _write_back(self, node: TreeNode) -> bool:
        """Move an unlocked device leaf into the host tier; False when the host has no room."""
        n = len(node.key)
        short = n - self.host_pool.available_size()
        if short > 0:
            self._evict_host(short)
        host_slots = self.host_pool.alloc(n)
        if host_slots is None:
            return False
        self.host_pool.backup_from_device(self.kv_pool, node.value, host_slots)
        self.token_to_kv_pool_allocator.free(node.value)
        node.value, node.host_value = None, host_slots
        self._evictable_size -= n
        self._host_size += n
        self.stats.num_backed_up_tokens += n
        return True

    def _drop_subtree(self, node: TreeNode) -> None:
        """Take an unlocked device leaf and its host-only subtree out of the tree, freeing all."""
        del node.parent.children[self._child_key(node.key, node.extra_key)]
        self.token_to_kv_pool_allocator.free(node.value)
        self._evictable_size -= len(node.key)
        self.stats.num_dropped_tokens += len(node.key)
        stack = list(node.children.values())
        while stack:
            below = stack.pop()
            self.host_pool.free(below.host_value)
            self._host_size -= len(below.key)
            self.stats.num_dropped_tokens += len(below.key)
            stack.extend(below.children.values())

    def _evict_host(self, num_tokens: int) -> int:
        """Drop at least `num_tokens` host slots' nodes from the tree, LRU host leaves first."""
        heap = [(n.last_access_time, n.id, n) for n in self._nodes() if self._is_host_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[self._child_key(node.key, node.extra_key)]
            self.host_pool.free(node.host_value)
            self._host_size -= len(node.key)
            freed += len(node.key)
            if self._is_host_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        self.stats.num_host_evicted_tokens += freed
        return freed

    def _is_host_leaf(self, node: TreeNode) -> bool:
        return (node is not self.root and node.value is None and not node.children
                and node is not self._loading)

    # ---------------------------------------------------------------- checks

    def check_invariants(self) -> None:
        """`RadixCache.check_invariants`, and for the host tier: every node is in exactly
        one tier, host-only nodes are unlocked with host-only children, their slot count
        matches, no host slot is held twice or also free, and free + held = host size."""
        super().check_invariants()
        host_slots: list[int] = []
        for node in self._nodes():
            if node is self.root:
                continue
            assert (node.value is None) != (node.host_value is None), f"{node} is not in exactly one tier"
            if node.value is not None:
                continue
            assert len(node.host_value) == len(node.key), f"{node}: host value and key lengths differ"
            assert node.lock_ref == 0, f"host-only {node} is locked"
            assert all(c.value is None for c in node.children.values()), f"a device node below host-only {node}"
            host_slots.extend(node.host_value.tolist())
        assert len(host_slots) == self._host_size, f"host size {len(host_slots)} != {self._host_size}"
        assert len(set(host_slots)) == len(host_slots), "a host slot is held twice by the tree"
        self.host_pool.check_invariants()
        free = self.host_pool.available_size()
        held = torch.tensor(host_slots, dtype=torch.int64)
        assert not self.host_pool.allocator.is_free(held).any(), "a host slot held by the tree is also free"
        assert free + self._host_size == self.host_pool.size, (
            f"host slots leaked: {free} free + {self._host_size} held != {self.host_pool.size}"
        )

    def info(self) -> dict[str, int]:
        """Host-tier figures for /get_server_info, in tokens: hicache_host_total_tokens,
        hicache_host_used_tokens, and each `HiCacheStats` total as hicache_<name> without num_."""
        stats = {f"hicache_{name.removeprefix('num_')}": value for name, value in asdict(self.stats).items()}
        return {"hicache_host_total_tokens": self.host_pool.size, "hicache_host_used_tokens": self._host_size, **stats}
