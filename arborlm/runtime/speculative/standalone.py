"""STANDALONE speculation: a smaller model with the target's tokenizer drafts, the target verifies.

The scheduler's side of it. `DraftModelSpeculator` is the n-gram `Speculator`
with another source of drafts: per decode step it works out how long a draft
each request may take (``max_new_tokens``, the context and the target's free
KV slots, at most ``speculative_num_steps``, and what the cost-aware switch
allows, `adaptive.AdaptivePolicy`: decided before the draft model runs),
asks the model worker's `DraftWorker` for them in one batch (a catch-up extend,
then decode steps), cuts each before the first token its grammar rejects, and
hands them to the same one-extend-step verify and acceptance as NGRAM
(`scheduling.build_verify_batch`, `verify.DraftVerifier`). After verification
the draft's KV of rejected tokens is freed at once; the draft KV of a request
that finished, was aborted or retracted is released at the end of the step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from arborlm.runtime.schedule_batch import Req
from arborlm.runtime.speculative.draft_worker import DraftWorker
from arborlm.runtime.speculative.scheduling import SpecReqState, Speculator, grammatical_prefix

logger = logging.getLogger(__name__)


@dataclass
class DraftModelSpeculator(Speculator):
    """Drafts from a draft model (`DraftWorker`); statistics and the cost-aware switch as `Speculator`'s.

    Parameters
    ----------
    config, context_length: as `Speculator` (``speculative_num_steps`` is the longest draft).
    draft_worker: the model worker's draft model and its KV.
    """

    # The draft model would first have to run a jump's forced tokens in its own KV: jumps
    # keep their extend step (`scheduling.jumps_take_drafts`).
    drafts_after_jumps = False

    draft_worker: DraftWorker | None = None

    def __post_init__(self):
        if self.draft_worker is None:
            raise ValueError("DraftModelSpeculator needs a draft_worker")
        self.num_steps = self.config.speculative_num_steps

    def propose_drafts(self, reqs: list[Req], free_slots: int) -> list[list[int]] | None:
        """A draft per request of a decode step, or None when none has one (a plain decode).

        A draft model failure is logged and the step decodes without drafts;
        the requests' draft KV is dropped (they catch up on a later step).
        """
        if self.batch_too_large(reqs):
            return None
        max_lens = []
        for req in reqs:
            room = max(0, min(self.num_steps, self.draft_room(req, free_slots)))
            free_slots -= room
            max_lens.append(room)
        lens = self.plan(reqs, max_lens)  # before the draft model runs: its steps are the cost
        if not any(lens):
            self.policy.start_step(self.policy.DECODE, len(reqs))
            return None
        self.policy.start_step(self.policy.VERIFY, len(reqs) + sum(lens))
        try:
            drafts = self.draft_worker.propose(reqs, lens)
        except Exception:  # noqa: BLE001 - a failed draft must not fail the requests
            logger.exception("draft model step failed; decoding %d request(s) without drafts", len(reqs))
            self.policy.timer.cancel()
            for req in reqs:
                self.draft_worker.release(req)
            return None
        finally:
            self.stats.num_draft_forward_steps = self.draft_worker.num_forward_steps
        for req, draft in zip(reqs, drafts):
            if req.grammar is not None:
                draft[:] = grammatical_prefix(req.grammar, draft)
            self._state(req).last_draft_len = len(draft)
        self.policy.timer.retag(self.policy.VERIFY if any(drafts) else self.policy.DECODE,
                                len(reqs) + sum(map(len, drafts)))
        return drafts if any(drafts) else None

    def _state(self, req: Req) -> SpecReqState:
        if req.spec_state is None:
            req.spec_state = SpecReqState(None, self.policy.new_estimate())
        return req.spec_state

    def on_verified(self, req: Req, draft_len: int, num_emitted: int) -> None:
        """Count the result (see `Speculator.on_verified`) and free the draft's KV of rejected tokens."""
        super().on_verified(req, draft_len, num_emitted)
        self.draft_worker.trim(req)

    def on_finished(self, req: Req) -> None:
        """Release the finished request's draft KV and drop its drafting state."""
        self.draft_worker.release(req)
        req.spec_state = None

    def on_step_end(self) -> None:
        """Time the step (`Speculator.on_step_end`) and release the draft KV of requests that
        ended this step by an abort or were retracted."""
        super().on_step_end()
        self.draft_worker.release_dead()

    def clear_cache_pool(self) -> None:
        """The draft keeps no cache across requests; with none alive its pool is whole again."""
        self.draft_worker.release_dead()

    def check_invariants(self, alive: list[Req]) -> None:
        """Assert that every draft KV slot and row is free or held by one of ``alive`` (the
        requests holding a target row), never by a finished, aborted or retracted one."""
        self.draft_worker.check_invariants()
        live = set(map(id, alive))
        for state in self.draft_worker.states.values():
            assert id(state.req) in live, f"draft KV of {state.req.rid} outlives its target row"
