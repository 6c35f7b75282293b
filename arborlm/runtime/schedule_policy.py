"""Which waiting requests enter the next prefill batch, and in what order.

`SchedulePolicy.calc_priority` orders the waiting queue (`lpm`: longest cached
prefix first; `fcfs`: arrival order; `dfs-weight`: depth-first over the radix
tree, heaviest subtree first), as SGLang does (Zheng et al. 2024, §4).
`PrefillAdder` then admits requests in that order within the token budgets.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from arborlm.radix_cache.radix_cache import MatchResult, RadixCache
from arborlm.runtime.schedule_batch import Req

# Cap on the tokens one request is expected to still generate (SGLang clips its estimate the same way).
CLIP_MAX_NEW_TOKENS = 4096
# In-batch prefix sharing (SGLang's thresholds): a waiting request with at most this many
# cached tokens that shares its first IN_BATCH_PREFIX_LEN tokens with another waiting
# request waits one step, so that the other's prefill puts the prefix into the cache.
IN_BATCH_CACHED_THRESHOLD = 32
IN_BATCH_PREFIX_LEN = 32
# Above this queue length, prefix matching every request costs more than it saves.
LPM_MAX_QUEUE = 128


class SchedulePolicy:
    """Orders the waiting queue.

    Parameters
    ----------
    policy: "lpm", "fcfs" or "dfs-weight".
    tree_cache: the radix cache the prefixes are matched in.
    """

    def __init__(self, policy: str, tree_cache: RadixCache):
        self.policy = policy
        self.tree_cache = tree_cache
        self.deprioritized: set[str] = set()

    def calc_priority(self, waiting_queue: list[Req]) -> dict[str, MatchResult]:
        """Sort `waiting_queue` in place, most urgent first, and fill `deprioritized`.

        `deprioritized` holds the ids of requests that should wait one step
        because another waiting request is about to prefill the same
        uncached prefix.

        Returns
        -------
        The cache match of each request's `prefix_match_key()` by request id
        (empty under fcfs), valid until the cache is next inserted into or
        evicted from, so admission in the same step need not match again.
        """
        self.deprioritized = set()
        policy = self.policy
        if policy != "fcfs" and (self.tree_cache.disable or len(waiting_queue) > LPM_MAX_QUEUE):
            policy = "fcfs"
        if policy == "fcfs":
            return {}
        matches = {r.rid: self.tree_cache.match_prefix(r.prefix_match_key(), r.cache_salt) for r in waiting_queue}
        if policy == "lpm":
            waiting_queue.sort(key=lambda r: -len(matches[r.rid].device_indices))
        else:
            self._sort_dfs_weight(waiting_queue, matches)
        self._mark_in_batch_sharing(waiting_queue, matches)
        return matches

    def _mark_in_batch_sharing(self, waiting_queue: list[Req], matches: dict[str, MatchResult]) -> None:
        leaders: set[tuple] = set()
        for req in waiting_queue:
            cached = len(matches[req.rid].device_indices)
            if cached > IN_BATCH_CACHED_THRESHOLD or len(req.fill_ids) <= IN_BATCH_PREFIX_LEN:
                continue
            head = (req.cache_salt, *req.fill_ids[:IN_BATCH_PREFIX_LEN])
            if head in leaders:
                self.deprioritized.add(req.rid)
            else:
                leaders.add(head)

    def _sort_dfs_weight(self, waiting_queue: list[Req], matches: dict[str, MatchResult]) -> None:
        """Depth-first over the tree, children with more waiting requests first."""
        by_node = defaultdict(list)
        weight: dict[int, int] = defaultdict(int)
        for req in waiting_queue:
            node = matches[req.rid].last_node
            by_node[id(node)].append(req)
            while node is not None:
                weight[id(node)] += 1
                node = node.parent
        ordered: list[Req] = []
        stack = [self.tree_cache.root]
        while stack:
            node = stack.pop()
            ordered.extend(by_node.get(id(node), []))
            children = [c for c in node.children.values() if weight.get(id(c), 0) > 0]
            stack.extend(sorted(children, key=lambda c: weight[id(c)]))
        waiting_queue[:] = ordered


@dataclass
class PrefillAdder:
    """Admits requests into one prefill batch within the KV and token budgets.

    The KV budget counts free slots plus evictable cache slots, minus what the
    running requests are expected to still need: `new_token_ratio` of their
    remaining `max_new_tokens` (SGLang's estimate, which adapts to retraction),
    so a huge `max_new_tokens` does not block admission.

    Parameters
    ----------
    rem_total_tokens: KV slots the batch may still take (tokens).
    rem_input_tokens: prefill tokens the batch may still compute (`max_prefill_tokens`).
    rem_chunk_tokens: chunk size for one long prompt; None disables chunking.
    new_token_ratio: share of remaining `max_new_tokens` reserved per request.
    context_length: max tokens of one request; nobody generates past it.
    """

    rem_total_tokens: int
    rem_input_tokens: int
    rem_chunk_tokens: int | None
    new_token_ratio: float
    context_length: int = 1 << 30
    can_run_list: list[Req] = field(default_factory=list)
    new_chunked_req: Req | None = None

    def reserve_running(self, running: list[Req]) -> None:
        """Set aside the expected future tokens of the running requests."""
        self.rem_total_tokens -= sum(self._future_tokens(r) for r in running)

    def _future_tokens(self, req: Req) -> int:
        remaining = min(req.remaining_new_tokens, self.context_length - req.seqlen, CLIP_MAX_NEW_TOKENS)
        return math.ceil(max(remaining, 0) * self.new_token_ratio)

    def budget_left(self) -> bool:
        return self.rem_total_tokens > 0 and self.rem_input_tokens > 0

    def add_one_req(self, req: Req, prefix_len: int, nothing_running: bool) -> bool:
        """Try to admit `req` whose first `prefix_len` fill tokens are cached.

        Sets `req.extend_input_len` (a chunk when chunking is on and the prompt
        exceeds the chunk or prefill budget; the request then becomes
        `new_chunked_req` and the batch takes no more) and returns True when
        admitted. The first request of an idle scheduler is always admitted, so
        nothing waits forever on a budget smaller than one prompt.
        """
        extend_len = len(req.fill_ids) - prefix_len
        first = nothing_running and not self.can_run_list
        chunked = False
        if self.rem_chunk_tokens is None:
            if extend_len > self.rem_input_tokens and not first:
                return False
        else:
            limit = min(self.rem_input_tokens, self.rem_chunk_tokens)
            if limit <= 0:
                return False
            if extend_len > limit:
                extend_len, chunked = limit, True
        future = 0 if chunked else self._future_tokens(req)
        if extend_len + future > self.rem_total_tokens and not first:
            return False
        req.extend_input_len = extend_len
        if chunked:
            self.new_chunked_req = req
        self.rem_total_tokens -= extend_len + future
        self.rem_input_tokens -= extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_len
        self.can_run_list.append(req)
        return True
