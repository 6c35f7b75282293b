"""Retraction: preempt running requests when the KV pool cannot hold one more decode step.

The youngest requests go back to the front of the waiting queue. Their KV goes
into the radix cache (unlocked, so it can be evicted), which makes re-admission
cheap when it survives. A retracted request keeps its output tokens and resumes
from them, so greedy decoding gives the same output. The new-token ratio is
raised so admission reserves more for running requests (as SGLang does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from arborlm.runtime.schedule_batch import Req

if TYPE_CHECKING:
    from arborlm.runtime.scheduler import Scheduler

# Decode steps of headroom assumed per remaining request when raising the ratio (SGLang's value).
RETRACT_DECODE_STEPS = 20


def retract_decode(scheduler: Scheduler) -> tuple[list[Req], float]:
    """Retract the youngest running requests until the rest can decode one token each.

    Returns
    -------
    (retracted requests, new token ratio in [current, 1]).
    The last running request is never retracted: the pool always holds one
    request of `context_length` tokens.
    """
    running = sorted(scheduler.running, key=lambda r: r.admitted_time)
    retracted: list[Req] = []
    while len(running) > 1 and not _fits(scheduler, len(running)):
        req = running.pop()
        scheduler.release_req(req)
        req.reset_for_retraction()
        retracted.append(req)
    scheduler.running = running
    scheduler.waiting_queue[:0] = reversed(retracted)
    decoded = sum(len(r.output_ids) for r in running)
    max_new = sum(r.sampling_params.max_new_tokens for r in running) or 1
    ratio = (decoded + RETRACT_DECODE_STEPS * len(running)) / max_new
    return retracted, min(1.0, max(scheduler.new_token_ratio, ratio))


def _fits(scheduler: Scheduler, num_tokens: int) -> bool:
    available = scheduler.allocator.available_size() + scheduler.tree_cache.evictable_size()
    return available >= num_tokens
