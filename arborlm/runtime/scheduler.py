"""The scheduler: iteration-level continuous batching over the radix cache.

Owns the model runner, the KV pools and the radix cache. Its loop is
receive → get next batch → run batch → process result. A step is either an
extend (prefill) of newly admitted requests, chunked when prompts are long, or
one decode token for every running request. Finished requests put their KV
into the radix cache so later requests reuse it (SGLang, Zheng et al. 2024).
Runs in its own process (`run_scheduler_process`) or in-process for tests.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from arborlm.constrained.base import GrammarError
from arborlm.constrained.grammar_manager import (
    GrammarManager,
    PendingGrammar,
    create_grammar_backend,
)
from arborlm.constrained.jump_forward import jump_forward_tokens
from arborlm.radix_cache.radix_cache import MatchResult, RadixCache
from arborlm.runtime.config import ServerArgs
from arborlm.runtime.forward_batch_info import ForwardMode
from arborlm.runtime.io_struct import (
    AbortReq,
    FlushCacheReq,
    GetInfoReq,
    InfoOut,
    ReqOutput,
    TokenizedGenerateReqInput,
)
from arborlm.runtime.model_runner import ModelRunner
from arborlm.runtime.retract import retract_decode, step_tokens
from arborlm.runtime.schedule_batch import Req, ScheduleBatch
from arborlm.runtime.schedule_policy import PrefillAdder, SchedulePolicy
from arborlm.runtime.scheduler_output import SchedulerOutputProcessor

logger = logging.getLogger(__name__)

# Seconds the loop waits for a grammar compile when it has nothing else to run.
GRAMMAR_POLL_S = 0.005


class Scheduler:
    """Continuous-batching scheduler.

    Parameters
    ----------
    server_args: every knob (see `config.py`).
    model_runner: an already built runner (tests share one); built from
        `server_args` when None.
    tokenizer: for stop strings; loaded from the checkpoint when None.
    """

    def __init__(self, server_args: ServerArgs, model_runner: ModelRunner | None = None, tokenizer=None):
        self.server_args = server_args
        self.model_runner = model_runner or ModelRunner(server_args)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(self.model_runner.checkpoint))
        self.tokenizer = tokenizer
        mr = self.model_runner
        self.req_to_token_pool = mr.req_to_token_pool
        self.token_to_kv_pool = mr.token_to_kv_pool
        self.allocator = mr.token_to_kv_pool_allocator
        self.tree_cache = RadixCache(
            self.allocator,
            page_size=server_args.cache.page_size,
            disable=server_args.cache.disable_radix_cache,
        )
        sched = server_args.scheduler
        self.policy = SchedulePolicy(sched.schedule_policy, self.tree_cache)
        self.model_info = mr.model_info(tokenizer)
        self.output_processor = SchedulerOutputProcessor(
            tokenizer, self.model_info.eos_token_ids, mr.vocab_size, mr.context_length, mr.device
        )
        self.waiting_queue: list[Req] = []
        # Constrained requests whose grammar is still compiling (in the grammar worker thread).
        self.grammar_queue: list[tuple[Req, PendingGrammar]] = []
        self._grammar_manager: GrammarManager | None = None
        # Requests that appended forced tokens and need one extend step before decoding on.
        self.jump_forward_reqs: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = sched.init_new_token_ratio
        self.pending_outputs: list[ReqOutput] = []
        self.stats = {
            "num_prompt_tokens": 0,
            "num_cached_tokens": 0,
            "num_prefill_tokens_computed": 0,
            "num_generated_tokens": 0,
            "num_retractions": 0,
            "num_decode_steps": 0,
            "num_extend_steps": 0,
            "num_mixed_steps": 0,
            "num_grammar_reqs": 0,
            "num_grammar_failures": 0,
            "num_jump_forward_tokens": 0,
            "num_jump_forward_steps": 0,
        }

    # ---- inputs -------------------------------------------------------------

    def handle(self, message: Any) -> InfoOut | None:
        """Apply one message from the front; returns a reply for info requests."""
        if isinstance(message, TokenizedGenerateReqInput):
            self.add_request(message)
        elif isinstance(message, AbortReq):
            self.abort_request(message.rid)
        elif isinstance(message, FlushCacheReq):
            return InfoOut({"success": self.flush_cache()})
        elif isinstance(message, GetInfoReq):
            if message.check_invariants:
                self.check_invariants()
            return InfoOut(self.get_info())
        else:
            logger.error("scheduler got an unknown message %r", type(message))
        return None

    def add_request(self, recv: TokenizedGenerateReqInput) -> None:
        """Queue a validated request (the front checked lengths and sampling fields)."""
        req = Req(
            rid=recv.rid,
            origin_input_ids=list(recv.input_ids),
            sampling_params=recv.sampling_params,
            seed=recv.seed,
            return_logprob=recv.return_logprob,
            logprob_start_len=recv.logprob_start_len,
            top_logprobs_num=recv.top_logprobs_num,
            cache_salt=recv.cache_salt,
        )
        # The front validates; this guards the in-process path against internal misuse.
        if not req.origin_input_ids or len(req.origin_input_ids) >= self.model_runner.context_length:
            req.finish_reason = {"type": "abort", "message": "prompt is empty or longer than the context"}
            self.pending_outputs.append(self.output_processor.make_output(req, []))
            return
        if recv.grammar is not None:
            self.stats["num_grammar_reqs"] += 1
            self.grammar_queue.append((req, self.grammar_manager.request(recv.grammar.key)))
            return
        self.waiting_queue.append(req)

    @property
    def grammar_manager(self) -> GrammarManager:
        """Built on the first constrained request (the backend reads the whole vocabulary)."""
        if self._grammar_manager is None:
            cfg = self.server_args.grammar
            backend = create_grammar_backend(
                cfg.grammar_backend, self.tokenizer, self.model_runner.vocab_size, list(self.model_info.eos_token_ids)
            )
            self._grammar_manager = GrammarManager(backend, cfg.grammar_compile_timeout)
        return self._grammar_manager

    def poll_grammar_queue(self) -> None:
        """Move requests whose grammar compiled to the waiting queue; fail those whose did not."""
        if not self.grammar_queue:
            return
        now = time.monotonic()
        still = []
        for req, pending in self.grammar_queue:
            try:
                compiled = pending.result(now)
            except GrammarError as e:
                self.stats["num_grammar_failures"] += 1
                req.finish_reason = {"type": "abort", "message": e.message, "param": e.param or pending.key.param}
                self.pending_outputs.append(self.output_processor.make_output(req, []))
                continue
            if compiled is None:
                still.append((req, pending))
            else:
                req.grammar = compiled.new_matcher()
                self.waiting_queue.append(req)
        self.grammar_queue = still

    def abort_request(self, rid: str) -> None:
        """Abort a waiting request at once, a running one at the end of its step."""
        queued = [(i, req) for i, req in enumerate(self.waiting_queue) if req.rid == rid]
        compiling = [(i, req) for i, (req, _) in enumerate(self.grammar_queue) if req.rid == rid]
        for queue, found in ((self.waiting_queue, queued), (self.grammar_queue, compiling)):
            if found:
                i, req = found[0]
                del queue[i]
                req.finish_reason = {"type": "abort", "message": "aborted by request"}
                self.pending_outputs.append(self.output_processor.make_output(req, []))
                return
        for req in self.alive_reqs():
            if req.rid == rid:
                req.to_abort = True

    def alive_reqs(self) -> list[Req]:
        """Requests that hold a `req_to_token` row: running, chunked or jumping forward."""
        return self.running + self.jump_forward_reqs + ([self.chunked_req] if self.chunked_req else [])

    def flush_cache(self) -> bool:
        """Empty the radix cache; refused (False) while requests are in flight."""
        if self.waiting_queue or self.grammar_queue or self.alive_reqs():
            return False
        self.tree_cache.reset()
        return True

    # ---- the loop -----------------------------------------------------------

    def step(self) -> list[ReqOutput]:
        """One iteration: pick a batch, run it, return what every request produced."""
        self.poll_grammar_queue()
        batch = self.get_next_batch_to_run()
        outputs, self.pending_outputs = self.pending_outputs, []
        if batch is not None:
            outputs.extend(self.run_batch(batch))
        elif self.grammar_queue and not outputs:
            # Only compiles pending: wait a little for one instead of spinning.
            self.grammar_manager.wait_any([p for _, p in self.grammar_queue], GRAMMAR_POLL_S)
        return outputs

    def has_work(self) -> bool:
        return bool(
            self.waiting_queue or self.grammar_queue or self.alive_reqs() or self.pending_outputs
        )

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """Jump-forward extends (with new prompts beside them), else prefill; otherwise every
        running request decodes one token."""
        if self.jump_forward_reqs:
            self.prepare_decode_memory()  # may retract jumping requests too
        if self.jump_forward_reqs:
            # One extend step runs the forced tokens and, as one-token extends, every running
            # request's decode token: jumping never costs the others a forward pass. New
            # prompts are admitted into the same step, so a jump never delays a first token.
            jumping, self.jump_forward_reqs = self.jump_forward_reqs, []
            reqs = self.running + jumping
            for req in reqs:
                req.extend_input_len = req.seqlen - req.kv_len
            self.stats["num_jump_forward_steps"] += 1
            admitted = self.get_new_batch_prefill(alongside=jumping)
            return ScheduleBatch(reqs + (admitted.reqs if admitted is not None else []), ForwardMode.EXTEND)
        batch = self.get_new_batch_prefill()
        if batch is not None:
            self.mix_running_into(batch)
            return batch
        if not self.running:
            return None
        self.prepare_decode_memory()
        return ScheduleBatch(list(self.running), ForwardMode.DECODE)

    def get_new_batch_prefill(self, alongside: list[Req] | None = None) -> ScheduleBatch | None:
        """Admit waiting requests (and the next chunk of the chunked one) by policy.

        alongside: requests (jumping forward) that run in the same step besides the
        running ones: their future tokens are reserved like the running requests',
        and the tokens they and the running requests extend by in this step are taken
        off the budget first.
        """
        alongside = alongside or []
        sched = self.server_args.scheduler
        if self.chunked_req is None and not self.waiting_queue:
            return None
        chunk = sched.chunked_prefill_size if sched.chunked_prefill_size > 0 else None
        adder = PrefillAdder(
            rem_total_tokens=self.allocator.available_size() + self.tree_cache.evictable_size(),
            rem_input_tokens=sched.max_prefill_tokens,
            rem_chunk_tokens=chunk,
            new_token_ratio=self.new_token_ratio,
            context_length=self.model_runner.context_length,
        )
        adder.reserve_running(self.running + alongside)
        if alongside:
            adder.rem_total_tokens -= step_tokens(self.running + alongside)
        matches = {}
        if self.chunked_req is not None:
            # The next chunk must fit in the pool now: shrink it to the room left, or wait for
            # the running requests to free some (they reserved theirs) instead of failing.
            if adder.rem_total_tokens <= 0:
                return None
            adder.rem_chunk_tokens = min(adder.rem_chunk_tokens, adder.rem_total_tokens)
            req, self.chunked_req = self.chunked_req, None
            adder.add_one_req(req, req.kv_len, nothing_running=True)
        else:
            matches = self.policy.calc_priority(self.waiting_queue)
        for req in list(self.waiting_queue):
            if adder.new_chunked_req is not None or not adder.budget_left():
                break
            if req.rid in self.policy.deprioritized:
                continue
            if len(self.running) + len(alongside) + len(adder.can_run_list) >= self.model_runner.max_running_requests:
                break
            if not self._admit(req, adder, matches.get(req.rid), nothing_running=not (self.running or alongside)):
                break
            self.waiting_queue.remove(req)
        self.chunked_req = adder.new_chunked_req
        if not adder.can_run_list:
            return None
        return ScheduleBatch(adder.can_run_list, ForwardMode.EXTEND)

    def mix_running_into(self, batch: ScheduleBatch) -> None:
        """Let every running request decode its next token inside this prefill step.

        Each joins as a one-token extend, so a prefill no longer stalls the running
        batch for a step, and the step's weights are read once for both (SGLang's
        mixed chunk). Skipped when disabled or when the pool cannot hold their tokens
        beside the prefill's without retracting (the next decode step retracts then).
        """
        if not self.server_args.scheduler.enable_mixed_chunk or not self.running:
            return
        need = sum(r.extend_input_len for r in batch.reqs) + len(self.running)
        if self.allocator.available_size() + self.tree_cache.evictable_size() < need:
            return
        for req in self.running:
            req.extend_input_len = 1
        batch.reqs = self.running + batch.reqs
        self.stats["num_mixed_steps"] += 1

    def _admit(self, req: Req, adder: PrefillAdder, match: MatchResult | None, nothing_running: bool) -> bool:
        """Lock the cached prefix (`match`, or a fresh one) and try to add `req`
        (`nothing_running`: no other request runs in this step)."""
        if match is None:
            match = self.tree_cache.match_prefix(req.prefix_match_key(), req.cache_salt)
        prefix_len = len(match.device_indices)
        # Locking the matched prefix takes it out of the evictable slots the budget counted on
        # (SGLang's PrefillAdder does the same): without this, a re-admitted retracted request
        # whose prefix filled the cache found no slot for its extend and was aborted.
        unlocked = self.tree_cache.inc_lock_ref(match.last_node)
        adder.rem_total_tokens += unlocked
        if not adder.add_one_req(req, prefix_len, nothing_running=nothing_running):
            adder.rem_total_tokens += self.tree_cache.dec_lock_ref(match.last_node)
            return False
        rows = self.req_to_token_pool.alloc(1)
        if rows is None:
            adder.can_run_list.remove(req)
            adder.rem_total_tokens += self.tree_cache.dec_lock_ref(match.last_node)
            return False
        req.req_pool_idx = rows[0]
        req.prefix_indices = match.device_indices
        req.last_node = match.last_node
        req.kv_len = prefix_len
        self.req_to_token_pool.req_to_token[req.req_pool_idx, :prefix_len] = match.device_indices.to(torch.int32)
        if req.num_retractions == 0:
            req.cached_tokens = prefix_len
            self.stats["num_prompt_tokens"] += len(req.origin_input_ids)
            self.stats["num_cached_tokens"] += prefix_len
        req.admitted_time = time.monotonic()
        return True

    def alloc_slots(self, num_tokens: int) -> torch.Tensor | None:
        """Take KV slots, evicting unlocked cache leaves when the free list is short."""
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)
        return self.allocator.alloc(num_tokens)

    def prepare_decode_memory(self) -> None:
        """Make room for the next step, retracting the youngest requests if needed.

        The step takes one slot per running request plus, per jumping request, its
        forced tokens and its next token (`retract.step_tokens`).
        """
        sched = self.server_args.scheduler
        need = step_tokens(self.running + self.jump_forward_reqs)
        if self.allocator.available_size() + self.tree_cache.evictable_size() >= need:
            self.new_token_ratio = max(sched.min_new_token_ratio, self.new_token_ratio - sched.new_token_ratio_decay)
            return
        retracted, self.new_token_ratio = retract_decode(self)
        self.stats["num_retractions"] += len(retracted)
        logger.info("KV cache full: retracted %d request(s); new_token_ratio=%.2f", len(retracted), self.new_token_ratio)

    def run_batch(self, batch: ScheduleBatch) -> list[ReqOutput]:
        """Run one step; a failure aborts that batch's requests and nothing else."""
        try:
            return self._run_batch(batch)
        except Exception as e:  # noqa: BLE001 - one bad step must not kill the server
            logger.exception("forward step failed; aborting its %d request(s)", len(batch.reqs))
            outputs = []
            for req in batch.reqs:
                req.finish_reason = {"type": "abort", "message": f"internal error: {e}"}
                self.release_req(req)
                outputs.append(self.output_processor.make_output(req, []))
            self.running = [r for r in self.running if not r.finished]
            self.jump_forward_reqs = [r for r in self.jump_forward_reqs if not r.finished]
            if self.chunked_req is not None and self.chunked_req.finished:
                self.chunked_req = None
            return outputs

    def _run_batch(self, batch: ScheduleBatch) -> list[ReqOutput]:
        mr = self.model_runner
        if batch.forward_mode.is_extend():
            num_new = sum(r.extend_input_len for r in batch.reqs)
            out_cache_loc = self.alloc_slots(num_new)
            if out_cache_loc is None:
                raise RuntimeError(f"out of KV slots for an extend of {num_new} tokens")
            forward_batch = batch.prepare_extend(self.req_to_token_pool, self.token_to_kv_pool, out_cache_loc)
            self.stats["num_extend_steps"] += 1
            self.stats["num_prefill_tokens_computed"] += num_new
        else:
            out_cache_loc = self.alloc_slots(len(batch.reqs))
            if out_cache_loc is None:
                raise RuntimeError("out of KV slots for a decode step")
            forward_batch = batch.prepare_decode(self.req_to_token_pool, self.token_to_kv_pool, out_cache_loc)
            self.stats["num_decode_steps"] += 1
        try:
            logits_output = mr.forward(forward_batch)
        except Exception:
            # The step's slots are past every request's kv_len: release_req would not free them.
            self.allocator.free(out_cache_loc)
            raise
        return self.process_batch_result(batch, logits_output, forward_batch)

    def process_batch_result(self, batch: ScheduleBatch, logits_output, forward_batch) -> list[ReqOutput]:
        """Sample, append tokens, finish requests and release their memory."""
        is_extend = batch.forward_mode.is_extend()
        for req in batch.reqs:
            req.kv_len += req.extend_input_len if is_extend else 1
        running = set(map(id, self.running))
        if is_extend:
            self.output_processor.collect_prompt_logprobs(batch.reqs, logits_output, forward_batch)
            for req in batch.reqs:
                if id(req) not in running:  # a decode token riding along adds nothing to share
                    self.cache_prefilled_prefix(req)
        outputs = []
        # A chunked request with prompt left samples nothing; nor does a prefill-only one.
        rows = []
        for i, req in enumerate(batch.reqs):
            if is_extend and req.kv_len < len(req.fill_ids):
                continue
            if req.sampling_params.max_new_tokens == 0:
                req.finish_reason = {"type": "length", "length": 0}
                outputs.append(self.output_processor.make_output(req, []))
                self.release_req(req)
                continue
            rows.append(i)
        sampling_reqs = [batch.reqs[i] for i in rows]
        logits = logits_output.next_token_logits
        sampled = self.output_processor.sample(sampling_reqs, logits if len(rows) == len(batch.reqs) else logits[rows])
        for req, token_id, logprob_info in zip(sampling_reqs, sampled.token_ids, sampled.logprob_infos):
            req.output_ids.append(token_id)
            self.stats["num_generated_tokens"] += 1
            self.output_processor.accept_grammar_token(req, token_id)
            self.output_processor.check_finished(req)
            forced = self.jump_forward(req)
            outputs.append(self.output_processor.make_output(req, [token_id, *forced], logprob_info))
            if req.finished:
                self.release_req(req)
            elif forced:
                self.jump_forward_reqs.append(req)
            elif is_extend and id(req) not in running:
                self.running.append(req)
        for req in batch.reqs:
            if req.to_abort and not req.finished:
                req.finish_reason = {"type": "abort", "message": "aborted by request"}
                outputs.append(self.output_processor.make_output(req, []))
                self.release_req(req)
                if self.chunked_req is req:
                    self.chunked_req = None
        self.running = [r for r in self.running if not r.finished and r not in self.jump_forward_reqs]
        return outputs

    def jump_forward(self, req: Req) -> list[int]:
        """Append the tokens `req`'s grammar forces now (see `constrained.jump_forward`).

        Returns them; the request then needs an extend step over them (it moves
        to `jump_forward_reqs`) instead of that many decode steps.
        """
        if req.finished or req.grammar is None or req.to_abort or self.server_args.grammar.disable_jump_forward:
            return []
        budget = min(req.remaining_new_tokens, self.model_runner.context_length - req.seqlen)
        # Leave room for the other jumps' extends and everyone's next token; never retract to jump.
        reserved = step_tokens(self.jump_forward_reqs) + len(self.running) + 2
        budget = min(budget, self.allocator.available_size() + self.tree_cache.evictable_size() - reserved)
        forced = jump_forward_tokens(req.grammar, self.tokenizer, req.output_ids, budget)
        if forced:
            req.output_ids.extend(forced)
            self.stats["num_jump_forward_tokens"] += len(forced)
            self.stats["num_generated_tokens"] += len(forced)
            self.output_processor.check_finished(req, num_new_tokens=len(forced))
        return forced

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
        """Hand a request's KV to the radix cache and its row back to the pool."""
        if req.req_pool_idx is None:
            return
        kv_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64)
        self.tree_cache.cache_finished_req(
            req.fill_ids[: req.kv_len], kv_indices, req.last_node, len(req.prefix_indices), req.cache_salt
        )
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    # ---- introspection ------------------------------------------------------

    def get_info(self) -> dict[str, Any]:
        """Live figures for /get_server_info and tests."""
        prompt = self.stats["num_prompt_tokens"]
        return {
            **self.stats,
            "num_running_reqs": len(self.alive_reqs()),
            "num_waiting_reqs": len(self.waiting_queue) + len(self.grammar_queue),
            "num_grammar_compiling": len(self.grammar_queue),
            "max_total_tokens": self.model_runner.max_total_tokens,
            "free_kv_tokens": self.allocator.available_size(),
            "cached_kv_tokens": self.tree_cache.total_size(),
            "evictable_kv_tokens": self.tree_cache.evictable_size(),
            "free_req_rows": self.req_to_token_pool.available_size(),
            "total_req_rows": self.req_to_token_pool.size,
            "cache_hit_rate": self.stats["num_cached_tokens"] / prompt if prompt else 0.0,
            "new_token_ratio": self.new_token_ratio,
        }

    def check_invariants(self) -> None:
        """Assert that every KV slot is free, in the cache, or owned by a live request."""
        self.allocator.check_invariants()
        self.req_to_token_pool.check_invariants()
        self.tree_cache.check_invariants()
        alive = self.alive_reqs()
        owned = sum(r.kv_len - len(r.prefix_indices) for r in alive)
        accounted = self.allocator.available_size() + self.tree_cache.total_size() + owned
        assert accounted == self.allocator.size, f"KV slots leaked: {accounted} != {self.allocator.size}"
        rows = self.req_to_token_pool.available_size() + len(alive)
        assert rows == self.req_to_token_pool.size, f"request rows leaked: {rows} != {self.req_to_token_pool.size}"
        if not alive:
            assert self.tree_cache.protected_size() == 0, "cache nodes still locked with no request alive"
