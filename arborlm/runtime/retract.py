"""Retraction: preempt running requests when the KV pool cannot hold the next step.

The next step needs one slot per running request (its decode token) plus, for
each request that jumped forward, its forced tokens and its own next token (the
extend of `Scheduler.jump_forward_reqs`). When the pool (free slots plus what the
radix cache can evict) holds less, the youngest requests, running or jumping,
go back to the front of the waiting queue. Their KV goes into the radix cache
(unlocked, so it can be evicted), which makes re-admission cheap when it
survives. A retracted request keeps its output tokens, forced ones included, and
resumes from them (its grammar matcher is already past them), so greedy decoding
gives the same output. The new-token ratio is raised so admission reserves more
for running requests (as SGLang does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from arborlm.runtime.schedule_batch import Req

if TYPE_CHECKING:
    from arborlm.runtime.scheduler import Scheduler

# Decode steps of headroom assumed per remaining request when raising the ratio (SGLang's value).
RETRACT_DECODE_STEPS = 20


def step_tokens(reqs: list[Req]) -> int:
    """KV slots the next step takes for ``reqs``: every token each has without KV yet.

    That is 1 for a request that decodes, and 1 + its forced tokens for one that jumped forward.
    """
    return sum(r.seqlen - r.kv_len for r in reqs)


def retract_decode(scheduler: Scheduler) -> tuple[list[Req], float]:
    """Retract the youngest running or jumping requests until the rest fit the next step.

    Returns
    -------
    (retracted requests, new token ratio in [current, 1]).
    The last request is never retracted: the pool always holds one request of
    `context_length` tokens, and a jump never takes more than the pool had free.
    """
    alive = sorted(scheduler.running + scheduler.jump_forward_reqs, key=lambda r: r.admitted_time)
    retracted: list[Req] = []
    while len(alive) > 1 and not _fits(scheduler, step_tokens(alive)):
        req = alive.pop()
        scheduler.release_req(req)
        req.reset_for_retraction()
        retracted.append(req)
    kept = set(map(id, alive))
    scheduler.running = [r for r in scheduler.running if id(r) in kept]
    scheduler.jump_forward_reqs = [r for r in scheduler.jump_forward_reqs if id(r) in kept]
    scheduler.waiting_queue[:0] = reversed(retracted)
    decoded = sum(len(r.output_ids) for r in alive)
    max_new = sum(r.sampling_params.max_new_tokens for r in alive) or 1
    ratio = (decoded + RETRACT_DECODE_STEPS * len(alive)) / max_new
    return retracted, min(1.0, max(scheduler.new_token_ratio, ratio))


def _fits(scheduler: Scheduler, num_tokens: int) -> bool:
    available = scheduler.allocator.available_size() + scheduler.tree_cache.evictable_size()
    return available >= num_tokens
