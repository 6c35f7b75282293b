"""The scheduler: iteration-level continuous batching over the radix cache.

Owns the request queues and decides what runs. Its step is receive →
`get_next_batch_to_run` → `run_batch` (the model worker's forward and sampling)
→ `process_batch_result` (append tokens, finish, release). A step is either an
extend (prefill) of newly admitted requests, chunked when prompts are long, or
one decode token for every running request. KV memory (admission budgets,
slots, the radix cache, retraction) is the `KVManager`'s; finished requests put
their KV into the radix cache so later requests reuse it (SGLang, Zheng et al.
2024). Runs in its own process (`run_scheduler_process`) or in-process for tests.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

from arborlm.constrained.base import GrammarError
from arborlm.constrained.grammar_manager import (
    GrammarManager,
    PendingGrammar,
    create_grammar_backend,
)
from arborlm.constrained.jump_forward import jump_forward_tokens
from arborlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
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
from arborlm.runtime.kv_manager import KVManager, make_host_pool, step_tokens
from arborlm.runtime.model_runner import ModelRunner
from arborlm.runtime.model_worker import GenerationResult, ModelWorker, ModelWorkerBatch, Worker
from arborlm.runtime.schedule_batch import Req, ScheduleBatch
from arborlm.runtime.schedule_policy import PrefillAdder, SchedulePolicy
from arborlm.runtime.scheduler_output import SchedulerOutputProcessor
from arborlm.runtime.speculative import scheduling as spec

logger = logging.getLogger(__name__)

# Seconds the loop waits for a grammar compile when it has nothing else to run.
GRAMMAR_POLL_S = 0.005
# What a client reads when its step failed: the exception itself goes to the log only.
STEP_FAILED_MESSAGE = "internal error: the step running this request failed (details are in the server log)"
# All-masked rows land here too: a grammar that allows no token (a request's own stop id held
# back where the grammar needs it as text, say), not only NaN/inf logits.
NON_FINITE_MESSAGE = ("the request could not continue: no token had a finite probability "
                      "(non-finite logits, or a constraint that allows no token here)")


class Scheduler:
    """Continuous-batching scheduler.

    Parameters
    ----------
    server_args: every knob (see `config.py`).
    worker: runs each step (a fake one in tests); a `ModelWorker` over a
        `ModelRunner` built from `server_args` when None.
    tokenizer: for stop strings and grammars; when None, the `ModelWorker`'s
        (loaded from the checkpoint).

    Raises
    ------
    ValueError
        When a worker is given without a tokenizer.
    """

    def __init__(self, server_args: ServerArgs, worker: Worker | None = None, tokenizer=None):
        self.server_args = server_args
        if worker is None:
            worker = ModelWorker(ModelRunner(server_args), tokenizer)
            tokenizer = worker.tokenizer
        elif tokenizer is None:
            raise ValueError("Scheduler: an injected worker needs a tokenizer (tokenizer=None)")
        self.worker = worker
        self.tokenizer = tokenizer
        self.model_info = worker.model_info
        cache = server_args.cache
        # An embedding server keeps no prefix cache: mean and CLS pooling need every prompt token's state.
        no_radix = cache.disable_radix_cache or server_args.model.is_embedding
        self.kv = KVManager(
            worker.req_to_token_pool, worker.token_to_kv_pool_allocator, cache.page_size, no_radix,
            host_pool=make_host_pool(cache, worker.token_to_kv_pool), kv_pool=worker.token_to_kv_pool,
        )
        sched = server_args.scheduler
        self.policy = SchedulePolicy(sched.schedule_policy, self.kv.tree_cache)
        self.output_processor = SchedulerOutputProcessor(
            tokenizer, self.model_info.eos_token_ids, self.model_info.context_length
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
        self.speculator = spec.make_speculator(server_args.speculative, self.model_info.context_length,
                                               getattr(worker, "draft_worker", None), tokenizer=self.tokenizer)
        self.stats = {
            "num_prompt_tokens": 0,
            "num_cached_tokens": 0,
            "num_host_cached_tokens": 0,  # the part of num_cached_tokens loaded back from the host tier
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
            "num_non_finite_aborts": 0,
        }

    @property
    def tree_cache(self) -> RadixCache:
        """The KV manager's radix cache (for tests and benchmarks)."""
        return self.kv.tree_cache

    @property
    def allocator(self) -> TokenToKVPoolAllocator:
        """The KV manager's slot allocator (for tests and benchmarks)."""
        return self.kv.allocator

    @property
    def req_to_token_pool(self) -> ReqToTokenPool:
        """The KV manager's request rows (for tests and benchmarks)."""
        return self.kv.req_to_token_pool

    @property
    def model_runner(self) -> ModelRunner | None:
        """The worker's model runner; None for a worker without one (a fake in tests)."""
        return getattr(self.worker, "model_runner", None)

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
        if not req.origin_input_ids or len(req.origin_input_ids) >= self.model_info.context_length:
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
                cfg.grammar_backend, self.tokenizer, self.model_info.vocab_size, list(self.model_info.eos_token_ids)
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
                req.finish_reason = {"type": "abort", "message": e.message, "param": e.param or pending.key.param,
                                     "code": getattr(e, "code", None)}  # server_overloaded: a 503, not a 400
                self.pending_outputs.append(self.output_processor.make_output(req, []))
                continue
            if compiled is None:
                still.append((req, pending))
            else:
                req.grammar = compiled.new_matcher(req.sampling_params.stop_token_ids or ())
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
        """Empty the radix cache and NGRAM's recent-output index; refused (False) while requests are in flight."""
        if self.waiting_queue or self.grammar_queue or self.alive_reqs():
            return False
        self.kv.flush_cache()
        spec.clear_cache_pool(self.speculator)
        return True

    # ---- the loop -----------------------------------------------------------

    def step(self) -> list[ReqOutput]:
        """One iteration: pick a batch, run it, return what every request produced.

        A failure while running or processing the batch aborts that batch's
        requests alone (`abort_batch`); the loop keeps serving the others.
        """
        self.poll_grammar_queue()
        batch = self.get_next_batch_to_run()
        outputs, self.pending_outputs = self.pending_outputs, []
        if batch is None:
            if self.grammar_queue and not outputs:
                # Only compiles pending: wait a little for one instead of spinning.
                self.grammar_manager.wait_any([p for _, p in self.grammar_queue], GRAMMAR_POLL_S)
            return outputs
        try:
            result = self.run_batch(batch)
            outputs.extend(self.process_batch_result(batch, result))
        except Exception as e:  # noqa: BLE001 - one bad step must not kill the server
            outputs.extend(self.abort_batch(batch, e))
        if self.speculator is not None:
            self.speculator.on_step_end()
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
        if self.jump_forward_reqs and spec.jumps_take_drafts(self):
            return spec.jump_verify_batch(self)
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
        batch = ScheduleBatch(list(self.running), ForwardMode.DECODE)
        if self.speculator is not None:
            # Drafts take free slots only: evicting cached prefixes for a guess is a bad trade.
            batch.draft_tokens = self.speculator.propose_drafts(batch.reqs, self.allocator.available_size() - len(batch.reqs))
        return batch

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
            rem_total_tokens=self.kv.available_size(),
            rem_input_tokens=sched.max_prefill_tokens,
            rem_chunk_tokens=chunk,
            new_token_ratio=self.new_token_ratio,
            context_length=self.model_info.context_length,
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
            if len(self.running) + len(alongside) + len(adder.can_run_list) >= self.model_info.max_running_requests:
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
        if not self.kv.can_fit(sum(r.extend_input_len for r in batch.reqs) + len(self.running)):
            return
        for req in self.running:
            req.extend_input_len = 1
        batch.reqs = self.running + batch.reqs
        self.stats["num_mixed_steps"] += 1

    def _admit(self, req: Req, adder: PrefillAdder, match: MatchResult | None, nothing_running: bool) -> bool:
        """Lock the cached prefix (`match`, or a fresh one) and try to add `req`
        (`nothing_running`: no other request runs in this step)."""
        match, host_hit_len = self.kv.load_back(req, match)
        prefix_len = len(match.device_indices)
        adder.rem_total_tokens -= self.kv.lock_prefix(match)
        if not adder.add_one_req(req, prefix_len, nothing_running=nothing_running):
            adder.rem_total_tokens += self.kv.unlock_prefix(match)
            return False
        if not self.kv.assign_row(req, match):
            adder.can_run_list.remove(req)
            adder.rem_total_tokens += self.kv.unlock_prefix(match)
            return False
        if req.num_retractions == 0:
            req.cached_tokens = prefix_len
            self.stats["num_prompt_tokens"] += len(req.origin_input_ids)
            self.stats["num_cached_tokens"] += prefix_len
            self.stats["num_host_cached_tokens"] += host_hit_len
        req.admitted_time = time.monotonic()
        return True

    def prepare_decode_memory(self) -> None:
        """Make room for the next step, retracting the youngest requests if needed.

        The step takes one slot per running request plus, per jumping request, its
        forced tokens and its next token (`kv_manager.step_tokens`). Retracted
        requests (the chunked one first, see `KVManager.retract_decode`) go back
        to the front of the waiting queue.
        """
        sched = self.server_args.scheduler
        alive = self.running + self.jump_forward_reqs
        if self.kv.can_fit(step_tokens(alive)):
            self.new_token_ratio = max(sched.min_new_token_ratio, self.new_token_ratio - sched.new_token_ratio_decay)
            return
        retraction = self.kv.retract_decode(alive, self.new_token_ratio, self.chunked_req)
        taken = set(map(id, retraction.retracted))
        if id(self.chunked_req) in taken:
            self.chunked_req = None
        self.running = [r for r in self.running if id(r) not in taken]
        self.jump_forward_reqs = [r for r in self.jump_forward_reqs if id(r) not in taken]
        self.waiting_queue[:0] = reversed(retraction.retracted)
        self.new_token_ratio = retraction.new_token_ratio
        self.stats["num_retractions"] += len(retraction.retracted)
        logger.info("KV cache full: retracted %d request(s); new_token_ratio=%.2f", len(taken), self.new_token_ratio)

    def run_batch(self, batch: ScheduleBatch) -> GenerationResult:
        """Allocate the step's KV slots, build its `ForwardBatch` and run the worker on it.

        Sets `batch.sample_rows`. Raises RuntimeError when the pool cannot hold
        the step's new tokens, and whatever the worker raises; the step's slots
        are freed first (no request's `kv_len` covers them yet).
        """
        is_extend = batch.forward_mode.is_extend()
        num_new = sum(r.extend_input_len for r in batch.reqs) if is_extend else len(batch.reqs)
        if batch.draft_tokens is not None:
            num_new = spec.verify_num_tokens(batch.reqs, batch.draft_tokens)
        out_cache_loc = self.kv.alloc_slots(num_new)
        if out_cache_loc is None:
            raise RuntimeError(f"out of KV slots for an extend of {num_new} tokens" if is_extend
                               else "out of KV slots for a decode step")
        if is_extend:
            self.stats["num_extend_steps"] += 1
            self.stats["num_prefill_tokens_computed"] += num_new
        else:
            self.stats["num_decode_steps"] += 1
        batch.sample_rows = [i for i, req in enumerate(batch.reqs) if req.takes_next_token(is_extend)]
        try:
            prepare = batch.prepare_extend if is_extend else batch.prepare_decode
            if batch.draft_tokens is not None:
                prepare = partial(spec.build_verify_batch, batch.reqs, batch.draft_tokens)
            forward_batch = prepare(self.kv.req_to_token_pool, self.worker.token_to_kv_pool, out_cache_loc)
            result = self.worker.forward_batch_generation(
                ModelWorkerBatch(forward_batch, batch.reqs, batch.sample_rows, batch.draft_tokens))
            if batch.draft_tokens is None:
                result.check_shape(len(batch.sample_rows), len(batch.reqs))
            return result
        except Exception:
            self.kv.free_slots(out_cache_loc)
            raise

    def process_batch_result(self, batch: ScheduleBatch, result: GenerationResult) -> list[ReqOutput]:
        """Bookkeeping of a step the worker ran: advance every request over its new KV,
        append the sampled tokens, advance grammars, finish, jump forward, release."""
        if batch.draft_tokens is not None:
            return self._end_step(batch, spec.process_verify_result(self, batch, result))
        is_extend = batch.forward_mode.is_extend()
        running = set(map(id, self.running))
        for req, prompt_logprobs in zip(batch.reqs, result.prompt_logprobs):
            req.kv_len += req.extend_input_len if is_extend else 1
            self.output_processor.add_prompt_logprobs(req, prompt_logprobs)
            if is_extend and id(req) not in running:  # a decode token riding along adds nothing to share
                self.kv.cache_prefilled_prefix(req)
        outputs = self._finish_prefill_only(batch, result.embeddings)
        sampled = [batch.reqs[i] for i in batch.sample_rows]
        invalid = set(result.invalid_rows)
        for j, (req, token_id, logprob_info) in enumerate(zip(sampled, result.next_token_ids, result.logprob_infos)):
            if j in invalid:
                outputs.append(self.abort_non_finite(req))
                continue
            forced = self.append_token(req, token_id)
            outputs.append(self.output_processor.make_output(req, [token_id, *forced], logprob_info))
            if req.finished:
                if self.speculator is not None:
                    self.speculator.on_finished(req)
                self.kv.release_req(req)
            elif forced:
                self.jump_forward_reqs.append(req)
            elif is_extend and id(req) not in running:
                self.running.append(req)
        return self._end_step(batch, outputs)

    def _end_step(self, batch: ScheduleBatch, outputs: list[ReqOutput]) -> list[ReqOutput]:
        """Abort the rows the worker flagged and drop finished and jumping requests from the running set."""
        outputs.extend(self._abort_flagged(batch))
        self.running = [r for r in self.running if not r.finished and r not in self.jump_forward_reqs]
        return outputs

    def _finish_prefill_only(self, batch: ScheduleBatch, embeddings: list | None = None) -> list[ReqOutput]:
        """Finish the requests that asked for no new token once their prompt is in the cache;
        on an embedding server each output carries its request's vector (`embeddings`, per request)."""
        outputs = []
        sampled = set(batch.sample_rows)
        for i, req in enumerate(batch.reqs):
            if i in sampled or req.sampling_params.max_new_tokens != 0 or req.kv_len < len(req.fill_ids):
                continue
            req.finish_reason = {"type": "length", "length": 0}
            outputs.append(self.output_processor.make_output(req, []))
            if embeddings is not None:
                outputs[-1].embedding = embeddings[i]
            self.kv.release_req(req)
        return outputs

    def append_token(self, req: Req, token_id: int) -> list[int]:
        """Append a sampled token, advance the grammar, check the finish, then jump forward.

        Returns the tokens the grammar forced after it (see `jump_forward`).
        """
        req.output_ids.append(token_id)
        self.stats["num_generated_tokens"] += 1
        self.output_processor.accept_grammar_token(req, token_id)
        self.output_processor.check_finished(req)
        return self.jump_forward(req)

    def abort_non_finite(self, req: Req) -> ReqOutput:
        """Abort one request whose logits were not finite; the rest of its step goes on."""
        logger.error("request %s: non-finite logits or probabilities; aborting it alone", req.rid)
        self.stats["num_non_finite_aborts"] += 1
        req.finish_reason = {"type": "abort", "message": NON_FINITE_MESSAGE}
        self.kv.release_req(req)
        if self.chunked_req is req:
            self.chunked_req = None
        return self.output_processor.make_output(req, [])

    def _abort_flagged(self, batch: ScheduleBatch) -> list[ReqOutput]:
        """Finish the requests of this step that an abort flagged while they ran."""
        outputs = []
        for req in batch.reqs:
            if req.to_abort and not req.finished:
                req.finish_reason = {"type": "abort", "message": "aborted by request"}
                outputs.append(self.output_processor.make_output(req, []))
                self.kv.release_req(req)
                if self.chunked_req is req:
                    self.chunked_req = None
        return outputs

    def abort_batch(self, batch: ScheduleBatch, error: Exception) -> list[ReqOutput]:
        """Abort every request of a step that failed, release their memory; nothing else changes."""
        logger.error("forward step failed; aborting its %d request(s)", len(batch.reqs), exc_info=error)
        outputs = []
        for req in batch.reqs:
            # The exception's text (paths, torch messages) goes to the log, not to clients.
            req.finish_reason = {"type": "abort", "message": STEP_FAILED_MESSAGE}
            self.kv.release_req(req)
            outputs.append(self.output_processor.make_output(req, []))
        self.running = [r for r in self.running if not r.finished]
        self.jump_forward_reqs = [r for r in self.jump_forward_reqs if not r.finished]
        if self.chunked_req is not None and self.chunked_req.finished:
            self.chunked_req = None
        return outputs

    def jump_forward(self, req: Req) -> list[int]:
        """Append the tokens `req`'s grammar forces now (see `constrained.jump_forward`).

        Returns them; the request then needs an extend step over them (it moves
        to `jump_forward_reqs`) instead of that many decode steps.
        """
        if req.finished or req.grammar is None or req.to_abort or self.server_args.grammar.disable_jump_forward:
            return []
        budget = min(req.remaining_new_tokens, self.model_info.context_length - req.seqlen)
        # Leave room for the other jumps' extends and everyone's next token; never retract to jump.
        reserved = step_tokens(self.jump_forward_reqs) + len(self.running) + 2
        budget = min(budget, self.kv.available_size() - reserved)
        forced = jump_forward_tokens(req.grammar, self.tokenizer, req.output_ids, budget)
        if forced:
            req.output_ids.extend(forced)
            self.stats["num_jump_forward_tokens"] += len(forced)
            self.stats["num_generated_tokens"] += len(forced)
            self.output_processor.check_finished(req, num_new_tokens=len(forced))
        return forced

    # ---- introspection ------------------------------------------------------

    def get_info(self) -> dict[str, Any]:
        """Live figures for /get_server_info and tests."""
        prompt = self.stats["num_prompt_tokens"]
        return {
            **self.stats,
            "num_running_reqs": len(self.alive_reqs()),
            "num_waiting_reqs": len(self.waiting_queue) + len(self.grammar_queue),
            "num_grammar_compiling": len(self.grammar_queue),
            "max_total_tokens": self.model_info.max_total_tokens,
            **self.kv.usage(),
            "cache_hit_rate": self.stats["num_cached_tokens"] / prompt if prompt else 0.0,
            "device_cache_hit_rate": (self.stats["num_cached_tokens"] - self.stats["num_host_cached_tokens"]) / prompt
            if prompt else 0.0,
            "host_cache_hit_rate": self.stats["num_host_cached_tokens"] / prompt if prompt else 0.0,
            "new_token_ratio": self.new_token_ratio,
            **(self.speculator.stats.as_dict() if self.speculator is not None else {}),
        }

    def check_invariants(self) -> None:
        """Assert that every KV slot is free, in the cache, or owned by a live request,
        and every request row free or a live request's (`KVManager.check_invariants`); the same of the draft's."""
        self.kv.check_invariants(self.alive_reqs())
        spec.check_invariants(self.speculator, self.alive_reqs())

