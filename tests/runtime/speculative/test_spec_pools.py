"""The speculator's memory in the scheduler's invariants, and what `flush_cache` forgets.

`Scheduler.check_invariants` (which `run_to_completion` calls after every step
and `get_server_info(check_invariants=True)` on demand) checks the STANDALONE
draft model's KV pool too: every draft slot and row is free or held by a
request that holds a target row. These tests break that on purpose and expect
the check to say so; and they check that `flush_cache` empties NGRAM's
recent-output index (SGLang's NGRAM worker resets its n-gram cache there), so a
second run of the same prompts drafts nothing from the first.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.runtime.scheduler_helpers import make_req, run_to_completion
from tests.runtime.speculative.test_spec_model import copy_prompts
from tests.runtime.speculative.test_spec_scheduler_fake_worker import create_spec_scheduler
from tests.runtime.speculative.test_standalone import assert_draft_pool_whole, standalone


def distinct_script(rid: str, n: int = 30) -> list[int]:
    """An output with no n-gram repeated in itself or its prompt: prompt lookup never drafts."""
    base = 100 + 50 * int(rid[1:])
    return list(range(base, base + n))


@pytest.mark.parametrize("flush, drafts_from_the_first_run", [(True, False), (False, True)])
def test_flush_cache_forgets_recent_outputs(flush, drafts_from_the_first_run):
    """The same requests twice: without a flush in between, the second run drafts (and the
    target accepts) what the first generated; after a flush it drafts nothing."""
    scripts = {rid: distinct_script(rid) for rid in ("r0", "r1")}

    def reqs():
        return [make_req(rid, [5, 6, 7, 8], max_new_tokens=30, ignore_eos=True) for rid in scripts]

    sched = create_spec_scheduler(scripts, speculative_ngram_min_match_window_size=2)
    first = run_to_completion(sched, reqs())
    assert sched.get_info()["spec_num_draft_tokens"] == 0
    if flush:
        assert sched.flush_cache()
    second = run_to_completion(sched, reqs())
    assert second.tokens == first.tokens == {rid: s for rid, s in scripts.items()}
    info = sched.get_info()
    assert (info["spec_num_accepted_tokens"] > 20) is drafts_from_the_first_run
    assert (info["spec_num_draft_tokens"] > 0) is drafts_from_the_first_run
    assert (second.steps < first.steps) is drafts_from_the_first_run


@pytest.fixture
def sched(tiny_llama_dir, tiny_tokenizer):
    """STANDALONE with the target as its own draft (no extra checkpoint to build)."""
    return standalone(tiny_llama_dir, tiny_tokenizer, tiny_llama_dir)


def _run_partway(sched, steps: int = 3):
    for i, p in enumerate(copy_prompts(2, seed=5)):
        sched.add_request(make_req(f"r{i}", p, max_new_tokens=40, ignore_eos=True))
    for _ in range(steps):
        sched.step()
        sched.check_invariants()
    draft = sched.worker.draft_worker
    assert draft.states, "the draft holds KV mid-run"
    return draft


def _finish(sched):
    run_to_completion(sched, [])
    assert_draft_pool_whole(sched)


def test_a_leaked_draft_slot_is_caught(sched):
    """A draft slot taken by nobody's state fails the scheduler's check, mid-run and idle."""
    draft = _run_partway(sched)
    leaked = draft.allocator.alloc(1)
    with pytest.raises(AssertionError, match="draft KV slots leaked"):
        sched.check_invariants()
    draft.allocator.free(leaked)
    sched.check_invariants()
    _finish(sched)


def test_draft_kv_of_a_request_without_a_target_row_is_caught(sched):
    """Draft KV kept for a request the target no longer runs (finished, aborted or retracted
    without the draft being told) fails the scheduler's check."""
    draft = _run_partway(sched)
    ghost = SimpleNamespace(rid="ghost")  # a request no longer alive in the scheduler
    assert draft._state(ghost) is not None
    with pytest.raises(AssertionError, match="ghost outlives its target row"):
        sched.check_invariants()
    draft.release(ghost)
    sched.check_invariants()
    _finish(sched)
