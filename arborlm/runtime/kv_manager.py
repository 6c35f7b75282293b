"""KV memory of the scheduler: admission budgets, slot allocation, release and retraction.

`KVManager` owns the request rows (`ReqToTokenPool`), the KV slot allocator and
the radix cache over them. The scheduler asks it how many slots a step may take
(`available_size`: free slots plus what the cache can evict), for the slots of
each step (`alloc_slots`, evicting LRU leaves when short), to lock a request's
cached prefix and give it a row at admission, to share freshly prefilled KV
(`cache_prefilled_prefix`) and to hand a request's KV to the cache when it
leaves (`release_req`). When the next step does not fit, `retract_decode`
releases the youngest requests and returns them; the scheduler puts them back
in its waiting queue. It sits below the scheduler and never touches its queues.

With `enable_hierarchical_cache` the cache is a `HiRadixCache`: evicted nodes go
to a host tier (`make_host_pool` sizes it) and `load_back` copies a request's
host-tier prefix back into the pool when it is admitted.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import torch

from arborlm.radix_cache.hiradix_cache import HiRadixCache
from arborlm.radix_cache.host_pool import HostKVPool, host_file_dir, host_memory_available_bytes
from arborlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator
from arborlm.radix_cache.radix_cache import MatchResult, RadixCache
from arborlm.runtime.config import CacheConfig
from arborlm.runtime.schedule_batch import Req

# Decode steps of headroom assumed per remaining request when raising the ratio (SGLang's value).
RETRACT_DECODE_STEPS = 20


def make_host_pool(cache: CacheConfig, kv_pool: TokenToKVPool) -> HostKVPool | None:
    """The host tier `cache` asks for beside `kv_pool` (None unless `enable_hierarchical_cache`).

    Sized as SGLang sizes it: `hicache_size` GB (10^9 bytes) of K/V when set, else
    `hicache_ratio` times the device pool's tokens; at least one token.

    Raises
    ------
    ValueError
        Naming `hicache_size` (or `hicache_ratio`) when the tier is larger than the
        host memory available (MemAvailable) or, with the file backend, than the free
        disk space of the file's directory: checked before anything is allocated.
    """
    if not cache.enable_hierarchical_cache:
        return None
    per_token = TokenToKVPool.bytes_per_token(kv_pool.num_layers, kv_pool.num_kv_heads, kv_pool.head_dim,
                                              kv_pool.dtype)
    if cache.hicache_size > 0:
        size = int(cache.hicache_size * 10**9 // per_token)
    else:
        size = int(kv_pool.size * cache.hicache_ratio)
    size = max(1, size)
    _check_host_room(cache, (size + 1) * per_token)
    return HostKVPool.for_device_pool(kv_pool, size, cache.hicache_storage_backend)


def _check_host_room(cache: CacheConfig, tier_bytes: int) -> None:
    """Refuse, naming the argument that sized it, a host tier of `tier_bytes` that does not fit."""
    if cache.hicache_storage_backend == "file":
        where = host_file_dir()
        room, what = shutil.disk_usage(where).free, f"free disk space in {where}"
    else:
        room, what = host_memory_available_bytes(), "host memory available"
    if tier_bytes <= room:
        return
    name, value = (("hicache_size", cache.hicache_size) if cache.hicache_size > 0
                   else ("hicache_ratio", cache.hicache_ratio))
    raise ValueError(
        f"{name}={value!r} is invalid: the host KV tier would take {tier_bytes / 1e9:.1f} GB, more than the "
        f"{room / 1e9:.1f} GB of {what}"
    )


def step_tokens(reqs: list[Req]) -> int:
    """KV slots the next step takes for ``reqs``: every token each has without KV yet.

    That is 1 for a request that decodes, and 1 + its forced tokens for one that jumped forward.
    """
    return sum(r.seqlen - r.kv_len for r in reqs)


@dataclass
class Retraction:
    """What `KVManager.retract_decode` took back.

    retracted: released requests in the order taken back (the chunked
        request first, then the youngest first); each was reset by
        `Req.reset_for_retraction` and keeps its output tokens.
    new_token_ratio: the share of remaining `max_new_tokens` admission should
        reserve from now on, in [the ratio before, 1].
    """

    retracted: list[Req]
    new_token_ratio: float


class KVManager:
    """Request rows, KV slots and the radix cache, kept consistent with each other.

    Parameters
    ----------
    req_to_token_pool: one row of KV slot indices per admitted request.
    allocator: the free list of KV slots.
    page_size, disable_radix_cache: radix cache settings (`CacheConfig`).
    host_pool, kv_pool: a host tier and the device K/V buffers; with both the cache is
        a `HiRadixCache` over the two (see `make_host_pool`).

    Every slot is at all times free, owned by the cache, or owned by exactly one
    live request (positions `[len(prefix_indices), kv_len)` of its row);
    `check_invariants` asserts it.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, page_size: int = 1,
                 disable_radix_cache: bool = False, host_pool: HostKVPool | None = None,
                 kv_pool: TokenToKVPool | None = None):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        if host_pool is not None and kv_pool is not None and not disable_radix_cache:
            self.tree_cache: RadixCache = HiRadixCache(allocator, kv_pool, host_pool, page_size=page_size)
        else:
            self.tree_cache = RadixCache(allocator, page_size=page_size, disable=disable_radix_cache)

    # ---- budgets ------------------------------------------------------------

    def available_size(self) -> int:
        """Slots a step may take now: free ones plus unlocked cache slots eviction can free."""
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def can_fit(self, num_tokens: int) -> bool:
        return self.available_size() >= num_tokens

    # ---- admission ----------------------------------------------------------

    def match_prefix(self, req: Req) -> MatchResult:
        """The cached KV of `req.prefix_match_key()` in the request's cache namespace."""
        return self.tree_cache.match_prefix(req.prefix_match_key(), req.cache_salt)

    def load_back(self, req: Req, match: MatchResult | None = None) -> tuple[MatchResult, int]:
        """The prefix `req` is admitted with, its host-tier part copied back into the pool.

        Without a host tier this is `match` (or a fresh `match_prefix`). With one,
        `req` is matched again (an earlier admission of this step may have evicted
        part of `match`) and the host part loaded (`HiRadixCache.load_back`).

        Returns
        -------
        tuple[MatchResult, int]
            The device-resident match, and how many of its tokens came from the host tier.
        """
        if not isinstance(self.tree_cache, HiRadixCache):
            return (match if match is not None else self.match_prefix(req)), 0
        fresh = self.match_prefix(req)
        loaded = self.tree_cache.load_back(fresh)
        return loaded, len(loaded.device_indices) - len(fresh.device_indices)

    def lock_prefix(self, match: MatchResult) -> int:
        """Lock a matched prefix so eviction cannot take it while a request reads it.

        Returns the slots the lock took out of `available_size()` (>= 0):
        admission counted them as evictable and must take them off its budget
        (SGLang's PrefillAdder does the same). Without this, a re-admitted
        retracted request whose prefix filled the cache found no slot for its
        extend and was aborted.
        """
        return -self.tree_cache.inc_lock_ref(match.last_node)

    def unlock_prefix(self, match: MatchResult) -> int:
        """Undo `lock_prefix`; returns the slots given back to `available_size()` (>= 0)."""
        return self.tree_cache.dec_lock_ref(match.last_node)

    def assign_row(self, req: Req, match: MatchResult) -> bool:
        """Give `req` a `req_to_token` row starting with its locked prefix `match`.

        Sets `req_pool_idx`, `prefix_indices`, `last_node` and `kv_len`
        (= prefix length). Returns False, changing nothing, when no row is free.
        """
        rows = self.req_to_token_pool.alloc(1)
        if rows is None:
            return False
        prefix_len = len(match.device_indices)
        req.req_pool_idx = rows[0]
        req.prefix_indices = match.device_indices
        req.last_node = match.last_node
        req.kv_len = prefix_len
        self.req_to_token_pool.req_to_token[req.req_pool_idx, :prefix_len] = match.device_indices.to(torch.int32)
        return True

    # ---- slots --------------------------------------------------------------

    def alloc_slots(self, num_tokens: int) -> torch.Tensor | None:
        """Take `num_tokens` KV slots, (num_tokens,) int64, evicting unlocked cache leaves
        when the free list is short; None when even eviction cannot free enough."""
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)
        return self.allocator.alloc(num_tokens)

    def free_slots(self, slots: torch.Tensor) -> None:
        """Give back slots no request row accounts for (a step that failed before its
        requests' `kv_len` advanced over them)."""
        self.allocator.free(slots)

    # ---- the radix cache ----------------------------------------------------

    def cache_prefilled_prefix(self, req: Req) -> None:
        """Put a request's freshly prefilled KV into the radix cache at once (still locked).

        Waiting requests that share the prompt's prefix then match it on the next
        prefill step instead of recomputing it (SGLang's `cache_unfinished_req`).
        """
        if self.tree_cache.disable or req.to_abort:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        match = self.tree_cache.cache_unfinished_req(
            req.fill_ids[: req.kv_len], row[: req.kv_len].to(torch.int64), req.last_node, len(req.prefix_indices),
            req.cache_salt,
        )
        row[: len(match.device_indices)] = match.device_indices.to(torch.int32)
        req.prefix_indices, req.last_node = match.device_indices, match.last_node

    def release_req(self, req: Req) -> None:
        """Hand a request's KV to the radix cache (unlocked) and its row back to the pool.

        A no-op for a request without a row (never admitted, or released already).
        """
        if req.req_pool_idx is None:
            return
        kv_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64)
        self.tree_cache.cache_finished_req(
            req.fill_ids[: req.kv_len], kv_indices, req.last_node, len(req.prefix_indices), req.cache_salt
        )
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def flush_cache(self) -> None:
        """Empty the radix cache, host tier included (the caller makes sure no request is alive)."""
        self.tree_cache.reset()

    # ---- retraction ---------------------------------------------------------

    def retract_decode(self, reqs: list[Req], new_token_ratio: float, chunked_req: Req | None = None) -> Retraction:
        """Release the youngest of `reqs` (running or jumping) until the rest fit the next step.

        The next step takes `step_tokens(reqs)` slots: one per decoding request
        plus, per request that jumped forward, its forced tokens and its own
        next token. A retracted request's KV goes into the radix cache
        (unlocked, so it can be evicted), which makes re-admission cheap when it
        survives; it keeps its output tokens, forced ones included, and resumes
        from them (its grammar matcher is already past them), so greedy decoding
        gives the same output. The ratio is raised so admission reserves more
        for the requests that stay (as SGLang does).

        `chunked_req`, a prompt prefilled in part, takes no slot in this step but
        holds the slots of its chunks; it goes first. Left in place, it could fill
        the pool while the one request left to decode needs a slot, and that step
        failed with "out of KV slots".

        The oldest of `reqs` is never retracted: the pool always holds one request
        of `context_length` tokens, and a jump never takes more than the pool had free.
        """
        alive = sorted(reqs, key=lambda r: r.admitted_time)
        retracted: list[Req] = []
        if chunked_req is not None and not self.can_fit(step_tokens(alive)):
            self._retract(chunked_req)
            retracted.append(chunked_req)
        while len(alive) > 1 and not self.can_fit(step_tokens(alive)):
            req = alive.pop()
            self._retract(req)
            retracted.append(req)
        decoded = sum(len(r.output_ids) for r in alive)
        max_new = sum(r.sampling_params.max_new_tokens for r in alive) or 1
        ratio = (decoded + RETRACT_DECODE_STEPS * len(alive)) / max_new
        return Retraction(retracted, min(1.0, max(new_token_ratio, ratio)))

    def _retract(self, req: Req) -> None:
        self.release_req(req)
        req.reset_for_retraction()

    # ---- introspection ------------------------------------------------------

    def usage(self) -> dict[str, int]:
        """Pool and cache figures for /get_server_info (tokens and rows)."""
        return {
            "free_kv_tokens": self.allocator.available_size(),
            "cached_kv_tokens": self.tree_cache.total_size(),
            "evictable_kv_tokens": self.tree_cache.evictable_size(),
            "free_req_rows": self.req_to_token_pool.available_size(),
            "total_req_rows": self.req_to_token_pool.size,
            **(self.tree_cache.info() if isinstance(self.tree_cache, HiRadixCache) else {}),
        }

    def check_invariants(self, alive: list[Req]) -> None:
        """Assert that every KV slot is free, in the cache, or owned by one of `alive`
        (the requests holding a row), and that every row is free or theirs."""
        self.allocator.check_invariants()
        self.req_to_token_pool.check_invariants()
        self.tree_cache.check_invariants()
        owned = sum(r.kv_len - len(r.prefix_indices) for r in alive)
        accounted = self.allocator.available_size() + self.tree_cache.total_size() + owned
        assert accounted == self.allocator.size, f"KV slots leaked: {accounted} != {self.allocator.size}"
        rows = self.req_to_token_pool.available_size() + len(alive)
        assert rows == self.req_to_token_pool.size, f"request rows leaked: {rows} != {self.req_to_token_pool.size}"
        if not alive:
            assert self.tree_cache.protected_size() == 0, "cache nodes still locked with no request alive"
