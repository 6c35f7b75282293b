"""The scheduler's side of speculative decoding: which requests draft, the verify batch, bookkeeping.

Place in the request path: when the scheduler has built a decode step (after
`prepare_decode_memory` made room for one token per request), `Speculator`
proposes a draft per request (`propose_drafts`), cut to the KV slots left over,
to the request's remaining `max_new_tokens` and context, and before the first
token its grammar rejects. `build_verify_batch` turns the step into one extend
chain per request (its last token, then its draft). After the worker verified
(`verify.DraftVerifier`), the scheduler appends each request's accepted tokens
one by one (finish checks, stop strings and `max_new_tokens` cut them exactly),
keeps their KV in the row and frees the rest at once (`rejected_slots`).

Adaptive switch: no drafting at all while the decode batch holds
``speculative_disable_by_batch_size`` requests or more (a large batch is
compute-bound, and verify work is then no longer free); below that, the
cost-aware `adaptive.AdaptivePolicy` decides how many of the proposed draft
tokens each request takes (0: none), from the measured acceptance of each
draft's source (shared by every request: `ngram.NgramDrafter.propose`)
and the measured times of plain decode and verify steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from arborlm.runtime.config import SpeculativeConfig
from arborlm.runtime.forward_batch_info import ForwardBatch, ForwardMode
from arborlm.runtime.kv_manager import step_tokens
from arborlm.runtime.schedule_batch import Req, ScheduleBatch
from arborlm.runtime.speculative.adaptive import AcceptanceEstimate, AdaptivePolicy
from arborlm.runtime.speculative.ngram import NgramDrafter, PromptLookupIndex, TextLookup


@dataclass
class SpecReqState:
    """Drafting state of one request (kept on `Req.spec_state`)."""

    index: PromptLookupIndex | None  # NGRAM's prompt lookup (None for a draft model)
    acceptance: AcceptanceEstimate  # its drafts' estimated acceptance rate, for drafts without a source
    source: str | None = None  # where this step's draft came from (`Speculator.sources`); None: a draft model's
    last_draft_len: int = 0
    text: TextLookup | None = None  # NGRAM's prompt lookup on text (None: without a tokenizer)


@dataclass
class SpecStats:
    """Counters for /get_server_info and /metrics (tokens and steps)."""

    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens the verify steps emitted (accepted drafts + one each)
    num_verified_reqs: int = 0  # request-steps verified
    num_skipped_batches: int = 0  # decode steps left undrafted by the batch-size switch
    num_cost_skipped_batches: int = 0  # decode steps with drafts the cost-aware switch did not take
    num_draft_forward_steps: int = 0  # STANDALONE: draft model steps (prefill, catch-up and decode)

    def as_dict(self) -> dict[str, float]:
        accept_length = self.num_emitted_tokens / self.num_verified_reqs if self.num_verified_reqs else 0.0
        rate = self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return {
            "spec_num_verify_steps": self.num_verify_steps,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_draft_tokens,
            "spec_accept_rate": rate,
            "avg_spec_accept_length": accept_length,  # SGLang's name
            "spec_num_skipped_batches": self.num_skipped_batches,
            "spec_num_cost_skipped_batches": self.num_cost_skipped_batches,
            "spec_num_draft_forward_steps": self.num_draft_forward_steps,
        }


@dataclass
class Speculator:
    """Proposes n-gram drafts for a decode step and keeps the acceptance statistics.

    Parameters
    ----------
    config: the speculative settings (`SpeculativeConfig`, algorithm NGRAM).
    context_length: max tokens of one request (drafts never run past it).
    policy: the cost-aware switch (its clock is injectable for tests).
    tokenizer: the model's tokenizer, for the prompt lookup on text (None: token n-grams only).
    """

    config: SpeculativeConfig
    context_length: int
    stats: SpecStats = field(default_factory=SpecStats)
    policy: AdaptivePolicy = field(default_factory=AdaptivePolicy)
    tokenizer: object = None

    def __post_init__(self):
        cfg = self.config
        self._structural: list[int] | None = None
        # Acceptance per draft source (`NgramDrafter.propose`'s names, and "structural"),
        # shared by every request: a handful of keys (sources x match lengths).
        self.sources: dict[str, AcceptanceEstimate] = {}
        self.drafter = NgramDrafter(cfg.speculative_ngram_min_match_window_size,
                                    cfg.speculative_ngram_max_match_window_size,
                                    cfg.speculative_ngram_capacity, cfg.speculative_num_draft_tokens, self.tokenizer)

    # Drafts follow a jump's forced tokens in the same verify step (`jump_verify_batch`).
    drafts_after_jumps = True

    def propose_drafts(self, reqs: list[Req], free_slots: int, base_rows: int | None = None) -> list[list[int]] | None:
        """A draft per request of a decode step, or None when none has one (a plain decode).

        free_slots: KV slots the step may take beyond the tokens the requests run
        anyway; drafts are cut so their total fits.
        base_rows: the rows the step runs without drafts (default one per request;
        more where a request runs tokens a jump forced), for the cost model.
        """
        if self.batch_too_large(reqs):
            return None
        drafts = []
        for req in reqs:
            draft = self._draft(req, free_slots)
            free_slots -= len(draft)
            drafts.append(draft)
        lens = self.plan(reqs, [len(d) for d in drafts])
        for draft, n in zip(drafts, lens):
            del draft[n:]
        rows = len(reqs) if base_rows is None else base_rows
        self.policy.start_step(self.policy.VERIFY if any(lens) else self.policy.DECODE, rows + sum(lens))
        return drafts if any(lens) else None

    def batch_too_large(self, reqs: list[Req]) -> bool:
        """The batch-size switch: True (the step is timed as a plain decode) for a batch of
        ``speculative_disable_by_batch_size`` requests or more."""
        limit = self.config.speculative_disable_by_batch_size
        if limit and len(reqs) >= limit:
            self.stats.num_skipped_batches += 1
            self.policy.start_step(self.policy.DECODE, len(reqs))
            return True
        return False

    def plan(self, reqs: list[Req], max_lens: list[int]) -> list[int]:
        """How many of its ``max_lens[i]`` draft tokens each request takes (`AdaptivePolicy.plan`);
        a request that takes none counts a step without evidence (`AcceptanceEstimate.forget`)."""
        states = [self._state(req) for req in reqs]
        if self.config.speculative_adaptive:
            lens = self.policy.plan(max_lens, [self._estimate(s).rate for s in states])
        else:
            lens = list(max_lens)
        for state, n in zip(states, lens):
            state.last_draft_len = n
            if n == 0 and state.source is None:
                state.acceptance.forget()
        taken = {s.source for s, n in zip(states, lens) if n}
        for source in {s.source for s in states if s.source is not None} - taken:
            self._source_estimate(source).forget()  # once per step, however many requests offered its drafts
        if any(max_lens) and not any(lens):
            self.stats.num_cost_skipped_batches += 1
        return lens

    def _draft(self, req: Req, free_slots: int) -> list[int]:
        room = self.draft_room(req, free_slots)
        if room <= 0:
            return []
        state = req.spec_state
        draft, state.source = self.drafter.propose(state.index, req.fill_ids, room, state.text)
        if req.grammar is not None:
            draft = grammatical_prefix(req.grammar, draft)
            if not draft and self.tokenizer is not None:
                draft, state.source = structural_draft(req.grammar, self._structural_ids()), "structural"
        if not draft:
            state.source = None
        return draft

    def _estimate(self, state: SpecReqState) -> AcceptanceEstimate:
        """The acceptance estimate of the request's current draft: its source's, else its own."""
        return state.acceptance if state.source is None else self._source_estimate(state.source)

    def _source_estimate(self, source: str) -> AcceptanceEstimate:
        estimate = self.sources.get(source)
        if estimate is None:
            estimate = self.sources[source] = self.policy.new_source_estimate()
        return estimate

    def _structural_ids(self) -> list[int]:
        """The single-token ids of `STRUCTURAL_TEXTS` in this tokenizer (computed once)."""
        if self._structural is None:
            ids = []
            for text in STRUCTURAL_TEXTS:
                try:
                    encoded = self.tokenizer.encode(text, add_special_tokens=False)
                except Exception:  # noqa: BLE001 - drafts are optional
                    encoded = []
                if len(encoded) == 1:
                    ids.append(encoded[0])
            self._structural = ids
        return self._structural

    def draft_room(self, req: Req, free_slots: int) -> int:
        """The longest draft ``req`` may take this step (<= 0: none).

        The verify step emits up to len(draft) + 1 tokens: never past
        ``max_new_tokens`` or the context, and never more than ``free_slots``.
        """
        state = self._state(req)
        state.last_draft_len, state.source = 0, None
        if req.to_abort or free_slots <= 0:
            return 0
        room = min(req.remaining_new_tokens, self.context_length - req.seqlen) - 1
        return min(room, free_slots)

    def _state(self, req: Req) -> SpecReqState:
        if req.spec_state is None:
            # Text lookup for constrained requests only: their outputs wrap copied values in
            # syntax the prompt lacks (quotes, keys), where token n-grams miss. On free text
            # token n-grams already match, and its extra drafts cost more than they won
            # (bench_spec, batch 1: json 1.48-1.53x against 1.26-1.41x, copy 1.58-1.70x against 1.79-1.81x).
            text = self.drafter.new_text_lookup(req.origin_input_ids) if req.grammar is not None else None
            req.spec_state = SpecReqState(self.drafter.new_index(), self.policy.new_estimate(), text=text)
        return req.spec_state

    def on_verified(self, req: Req, draft_len: int, num_emitted: int) -> None:
        """Count one request's verify result and adapt its drafting (see the module docstring)."""
        accepted = max(0, min(draft_len, num_emitted - 1))
        req.spec_verify_ct += 1
        req.spec_accepted_tokens += accepted
        self.stats.num_verified_reqs += 1
        self.stats.num_draft_tokens += draft_len
        self.stats.num_accepted_draft_tokens += accepted
        self.stats.num_emitted_tokens += num_emitted
        if req.spec_state is not None:
            self._estimate(req.spec_state).observe(draft_len, accepted)

    def on_finished(self, req: Req) -> None:
        """Index a finished request's output for the others and drop its drafting state."""
        if req.finish_reason is not None and req.finish_reason.get("type") != "abort":
            self.drafter.on_finished(req.origin_input_ids, req.output_ids)
        req.spec_state = None

    def on_step_end(self) -> None:
        """Called after every scheduler step: the step's time goes into the cost model
        (n-gram drafting keeps nothing to release)."""
        self.policy.end_step()

    def clear_cache_pool(self) -> None:
        """Forget what finished requests generated (the scheduler's ``flush_cache``, when no
        request is alive; SGLang's NGRAM worker resets its n-gram cache there too)."""
        self.drafter.recent.clear()

    def check_invariants(self, alive: list[Req]) -> None:
        """Assert the speculator's own memory is consistent (NGRAM holds no KV: nothing to check)."""


def grammatical_prefix(grammar, draft: list[int]) -> list[int]:
    """The longest prefix of ``draft`` the matcher accepts, stopping before a token that
    ends the grammar (the target decides the end itself); the matcher is rolled back."""
    accepted = 0
    for token_id in draft:
        if not grammar.accept_token(token_id):
            break
        accepted += 1
        if grammar.is_terminated():
            break
    if accepted and grammar.is_terminated():
        grammar.rollback(1)
        accepted -= 1
    grammar.rollback(accepted)
    return draft[:accepted]


# JSON's structural tokens, probed when nothing else drafts for a constrained request.
STRUCTURAL_TEXTS = ("}", "]", ",", '"')


def structural_draft(grammar, candidates: list[int]) -> list[int]:
    """A one-token draft for a constrained request that nothing else drafted: the one
    structural token (``candidates``, e.g. the ids of ``}``, ``]``, ``,`` and ``"``) its
    grammar accepts now, when exactly one does and it does not end the grammar; else [].

    What it drafts is where JSON's syntax has one way on but whitespace keeps jump-forward
    from forcing it: ``}`` after an object's last value, ``,`` after a number when keys
    remain, ``"`` opening the first key after ``{``. Inside a string every candidate is
    content, so nothing is drafted there. The matcher is left as it was.
    """
    accepted = []
    for token_id in candidates:
        if grammar.accept_token(token_id):
            ends = grammar.is_terminated()
            grammar.rollback(1)
            if not ends:
                accepted.append(token_id)
            if len(accepted) > 1:
                return []
    return accepted


def clear_cache_pool(speculator: Speculator | None) -> None:
    """`Speculator.clear_cache_pool` when speculation is on (the scheduler's ``flush_cache``)."""
    if speculator is not None:
        speculator.clear_cache_pool()


def check_invariants(speculator: Speculator | None, alive: list[Req]) -> None:
    """`Speculator.check_invariants` when speculation is on (the scheduler's ``check_invariants``)."""
    if speculator is not None:
        speculator.check_invariants(alive)


def pending_len(req: Req) -> int:
    """Tokens ``req`` has without KV before its verify step's draft: 1 (its last token), or
    1 + the tokens its grammar forced after it when it jumped forward."""
    return req.seqlen - req.kv_len


def verify_num_tokens(reqs: list[Req], drafts: list[list[int]]) -> int:
    """KV slots a verify step takes: one chain of `pending_len` + len(draft) tokens per request."""
    return step_tokens(reqs) + sum(len(d) for d in drafts)


def jumps_take_drafts(scheduler) -> bool:
    """Whether the scheduler's jumps run as a verify step with drafts after the forced tokens:
    speculation that drafts without a model of its own (NGRAM; a draft model would first have
    to run the forced tokens itself), and no prompt waiting to be admitted beside them
    (admission rides on the jump's extend step instead)."""
    speculator = scheduler.speculator
    return (speculator is not None and speculator.drafts_after_jumps
            and not scheduler.waiting_queue and scheduler.chunked_req is None)


def jump_verify_batch(scheduler) -> ScheduleBatch:
    """The jumping requests' forced tokens as drafts that need no verification.

    One verify step runs, per request, every token it has without KV yet (a jumping
    request's last token and the tokens its grammar forced after it; a running
    request's last token) and then its draft, proposed after them. Every row after
    the first ``pending_len - 1`` of a chain is verified as in any verify step
    (`build_verify_batch`), so a value after a forced key can be drafted and accepted
    in the step that runs the key, where an extend step of the forced tokens alone
    would emit one token. The jumping requests join the running set.
    """
    jumping, scheduler.jump_forward_reqs = scheduler.jump_forward_reqs, []
    scheduler.running.extend(jumping)
    scheduler.stats["num_jump_forward_steps"] += 1
    reqs = list(scheduler.running)
    pending = step_tokens(reqs)
    batch = ScheduleBatch(reqs, ForwardMode.DECODE)
    drafts = scheduler.speculator.propose_drafts(reqs, scheduler.allocator.available_size() - pending,
                                                 base_rows=pending)
    batch.draft_tokens = drafts if drafts is not None else [[] for _ in reqs]
    return batch


def build_verify_batch(reqs: list[Req], drafts: list[list[int]], req_to_token_pool, token_to_kv_pool,
                       out_cache_loc: torch.Tensor) -> ForwardBatch:
    """The verify step as an extend `ForwardBatch` with logits at every position.

    Request i runs ``[*fill_ids[kv_len:], *drafts[i]]`` (its last token, after
    a jump the tokens its grammar forced, then its draft) at positions ``kv_len ..
    seqlen - 1 + len(drafts[i])``; `out_cache_loc` (verify_num_tokens(reqs, drafts),)
    int64 holds their fresh slots, request after request, and is written into
    each row of ``req_to_token``. The forced tokens need no verification: their
    rows' logits are not used (`verify_batch.draft_rows`).
    """
    input_ids: list[int] = []
    prefix_lens, extend_lens = [], []
    offset = 0
    for req, draft in zip(reqs, drafts):
        pending = pending_len(req)
        n = pending + len(draft)
        input_ids.extend(req.output_ids[-pending:] if pending <= len(req.output_ids) else req.fill_ids[req.kv_len:])
        input_ids.extend(draft)
        req_to_token_pool.req_to_token[req.req_pool_idx, req.kv_len : req.kv_len + n] = (
            out_cache_loc[offset : offset + n].to(torch.int32))
        offset += n
        prefix_lens.append(req.kv_len)
        extend_lens.append(n)
    return ForwardBatch.build(
        ForwardMode.EXTEND, input_ids, [r.req_pool_idx for r in reqs], prefix_lens, extend_lens,
        out_cache_loc, req_to_token_pool, token_to_kv_pool, return_full_logits=True,
    )


def rejected_slots(req_to_token_pool, req: Req, draft_len: int, num_kept: int) -> torch.Tensor:
    """The slots of a verified chain past the ``num_kept`` tokens it keeps, (n,) int64.

    Call before advancing ``req.kv_len``: the chain sits at positions
    ``kv_len .. kv_len + draft_len`` of the request's row.
    """
    start = req.kv_len + num_kept
    return req_to_token_pool.req_to_token[req.req_pool_idx, start : req.kv_len + 1 + draft_len].to(torch.int64)


def split_verify_tokens(accept_lens: list[int], items: list) -> list[list]:
    """``items`` (one per emitted token, requests in turn) cut into one list per request."""
    if sum(accept_lens) != len(items):
        raise RuntimeError(f"worker returned {len(items)} tokens for accept lengths summing to {sum(accept_lens)}")
    out, offset = [], 0
    for n in accept_lens:
        out.append(items[offset : offset + n])
        offset += n
    return out


def with_token_logprobs(out, infos: list) -> object:
    """Set the logprobs of a verify step's emitted tokens on its `ReqOutput` (in place; returned).

    infos: one `LogprobInfo` (or None: not asked) per kept token; tokens after
    them in ``out.new_token_ids`` were forced by the grammar (logprob 0).
    """
    if not infos or infos[0] is None:
        return out
    forced = out.new_token_ids[len(infos):]
    out.output_token_logprobs = [(i.logprob, i.token_id) for i in infos] + [(0.0, t) for t in forced]
    out.output_top_logprobs = [i.top for i in infos] + [[(0.0, t)] for t in forced]
    return out


def make_speculator(config: SpeculativeConfig, context_length: int, draft_worker=None,
                    tokenizer=None) -> Speculator | None:
    """The `Speculator` of ``config.speculative_algorithm``; None when speculation is off.

    draft_worker: the model worker's `DraftWorker` (STANDALONE; a ValueError when missing).
    tokenizer: NGRAM's, for the prompt lookup on text (None: token n-grams only).
    """
    if config.speculative_algorithm is None:
        return None
    if config.speculative_algorithm == "NGRAM":
        return Speculator(config, context_length, tokenizer=tokenizer)
    if config.speculative_algorithm == "STANDALONE":
        # Imported here: `standalone` builds on this module.
        from arborlm.runtime.speculative.standalone import DraftModelSpeculator

        if draft_worker is None:
            raise ValueError("speculative_algorithm='STANDALONE' needs a worker with a draft model "
                             "(speculative_draft_model_path)")
        return DraftModelSpeculator(config, context_length, draft_worker=draft_worker)
    raise ValueError(f"speculative_algorithm={config.speculative_algorithm!r} is not served")


def process_verify_result(scheduler, batch, result) -> list:
    """Bookkeeping of a speculative decode step, for `Scheduler.process_batch_result`.

    Each request appends its emitted tokens one by one, as decode steps would
    (grammar, finish checks, stop strings: `scheduler.append_token`), until one finishes
    it or forces a jump; then its row keeps the KV of the tokens it kept and the rest is
    freed at once. Should appending raise, every chain of the step is freed before the
    step is aborted (no request's `kv_len` covers any of them yet). Returns the step's
    outputs (the scheduler then aborts flagged rows and updates its running set).
    """
    kv = scheduler.kv
    # Tokens before each chain's verified rows: a jumping request's forced tokens (see
    # `build_verify_batch`); read before appending moves `seqlen`.
    skipped = [pending_len(req) - 1 for req in batch.reqs]
    # A jump step without any draft verifies nothing: it counts in no speculative statistic.
    drafted = any(batch.draft_tokens)
    invalid = set(result.invalid_rows)
    tokens = split_verify_tokens(result.accept_lens, result.next_token_ids)
    infos = split_verify_tokens(result.accept_lens, result.logprob_infos)
    pairs = list(zip(batch.reqs, batch.draft_tokens))
    try:
        appended = [_append_verified(scheduler, req, tokens[j], j in invalid) for j, (req, _) in enumerate(pairs)]
    except Exception:
        for (req, draft), skip in zip(pairs, skipped):
            kv.free_slots(rejected_slots(kv.req_to_token_pool, req, skip + len(draft), 0))
        raise
    outputs = []
    for j, ((req, draft), (kept, forced), skip) in enumerate(zip(pairs, appended, skipped)):
        kv.free_slots(rejected_slots(kv.req_to_token_pool, req, skip + len(draft), skip + max(1, len(kept))))
        req.kv_len += skip + max(1, len(kept))
        rewind_draws(req, kept, result.draw_states[j] if result.draw_states else None)
        if j in invalid:
            outputs.append(scheduler.abort_non_finite(req))
            continue
        if drafted:
            scheduler.speculator.on_verified(req, len(draft), len(kept))
        outputs.append(with_token_logprobs(scheduler.output_processor.make_output(req, kept + forced),
                                           infos[j][: len(kept)]))
        if req.finished:
            scheduler.speculator.on_finished(req)
            kv.release_req(req)
        elif forced:
            scheduler.jump_forward_reqs.append(req)
    if drafted:
        scheduler.speculator.stats.num_verify_steps += 1
    return outputs


def rewind_draws(req: Req, kept: list[int], states: list | None) -> None:
    """Set a sampled request's generator to its state after the draws of the ``kept`` tokens
    when a forced jump cut the tokens drawn after them (``states``: its state after each draw,
    `VerifyOutput.draw_states`): speculation off would have drawn nothing for them, so the
    next draw is the one it makes after the jump, and the same seed gives the same output."""
    if states and kept and not req.finished and len(kept) < len(states):
        req.generator.set_state(states[len(kept) - 1])


def _append_verified(scheduler, req: Req, tokens: list[int], invalid: bool) -> tuple[list[int], list[int]]:
    """Append a verified request's tokens until one finishes it or forces a jump;
    returns (the tokens kept, the tokens the grammar forced after them). An invalid
    row appends nothing (the request is aborted; its last token's KV is kept)."""
    kept: list[int] = []
    forced: list[int] = []
    if invalid:
        return kept, forced
    for token_id in tokens:
        kept.append(token_id)
        forced = scheduler.append_token(req, token_id)
        if req.finished or forced:
            break
    return kept, forced
