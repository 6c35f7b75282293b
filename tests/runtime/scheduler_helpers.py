"""Small factories for scheduler tests (in the manner of vLLM's `create_requests`).

`create_scheduler` runs a real model; `create_fake_scheduler` runs a
`ScriptedWorker` (no model, real pools and radix cache) for tests of the
scheduling and memory bookkeeping alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from arborlm.constrained.grammar_spec import grammar_spec_from_params
from arborlm.radix_cache.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator
from arborlm.runtime.config import ServerArgs
from arborlm.runtime.io_struct import ModelInfo, ReqOutput, TokenizedGenerateReqInput
from arborlm.runtime.model_runner import EXTRA_REQ_ROWS
from arborlm.runtime.model_worker import GenerationResult, ModelWorkerBatch
from arborlm.runtime.scheduler import Scheduler
from arborlm.sampling_params import SamplingParams

FAKE_VOCAB_SIZE = 1024
FAKE_EOS_ID = 2
FAKE_CONTEXT_LENGTH = 256


def create_scheduler(model_dir, tokenizer, **overrides) -> Scheduler:
    """A scheduler on `model_dir` in float32 with a small KV pool unless overridden."""
    kwargs = dict(model=str(model_dir), dtype="float32", max_total_tokens=4096, device="cpu")
    kwargs.update(overrides)
    return Scheduler(ServerArgs.from_kwargs(**kwargs), tokenizer=tokenizer)


def make_req(rid: str, input_ids: list[int], seed: int = 0, **sampling) -> TokenizedGenerateReqInput:
    """A tokenized request as the front makes it: a ``json_schema``, ``regex`` or ``ebnf`` in
    ``sampling`` becomes its grammar (the scheduler constrains by ``grammar`` alone)."""
    sampling.setdefault("temperature", 0.0)
    params = SamplingParams(**sampling).normalized()
    params.verify(49152)
    return TokenizedGenerateReqInput(rid=rid, input_ids=list(input_ids), sampling_params=params, seed=seed,
                                     grammar=grammar_spec_from_params(params, "auto"))


@dataclass
class RunResult:
    """Everything the scheduler produced per request."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, dict] = field(default_factory=dict)
    outputs: dict[str, list[ReqOutput]] = field(default_factory=dict)
    steps: int = 0


def run_to_completion(scheduler: Scheduler, reqs: list[TokenizedGenerateReqInput], max_steps: int = 10_000,
                      check_every_step: bool = True) -> RunResult:
    """Feed `reqs`, step until idle, collect outputs; checks pool invariants every step."""
    for req in reqs:
        scheduler.add_request(req)
    result = RunResult()
    while scheduler.has_work():
        assert result.steps < max_steps, "scheduler did not finish"
        for out in scheduler.step():
            result.tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            result.outputs.setdefault(out.rid, []).append(out)
            if out.finish_reason is not None:
                assert out.rid not in result.finish, f"{out.rid} finished twice"
                result.finish[out.rid] = out.finish_reason
        result.steps += 1
        if check_every_step:
            scheduler.check_invariants()
    assert_idle_pools(scheduler)
    return result


def assert_idle_pools(scheduler: Scheduler) -> None:
    """With no request alive, every KV slot is free or in the (unlocked) cache, every row free."""
    scheduler.check_invariants()
    assert scheduler.req_to_token_pool.available_size() == scheduler.req_to_token_pool.size
    assert scheduler.tree_cache.protected_size() == 0
    assert scheduler.allocator.available_size() + scheduler.tree_cache.total_size() == scheduler.allocator.size
    scheduler.tree_cache.reset()
    assert scheduler.allocator.available_size() == scheduler.allocator.size


@torch.inference_mode()
def reference_greedy(hf_model, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens by full recomputation with transformers (no KV cache, no EOS)."""
    ids = torch.tensor([input_ids])
    out = []
    for _ in range(max_new_tokens):
        next_id = int(hf_model(ids).logits[0, -1].argmax())
        out.append(next_id)
        ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return out


class LetterTokenizer:
    """Decodes token id `i` as the letter ``chr(ord("a") + i % 26)`` (stop strings without a vocabulary)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


class ScriptedWorker:
    """A model worker without a model: request `rid`'s k-th output token is `scripts[rid][k]`.

    Its "KV" of a slot is the token there (K) and its position (V). Each step
    writes them at `out_cache_loc` and then reads back every request's row
    `req_to_token[row, :seq_len]`, recording in `kv_errors` any position whose
    slot does not hold the request's own token: what a real model would read
    as a wrong prefix (a cache, chunking or retraction bug).

    `fail_at`: step numbers (1-based calls) at which it raises instead, or
    (`malformed_at`) returns one token too few. `non_finite_at`: step number ->
    request ids whose row that step reports as non-finite (as the sampler
    does for NaN/inf logits).
    """

    def __init__(self, server_args: ServerArgs, scripts: dict[str, list[int]]):
        self.scripts = scripts
        max_total_tokens = server_args.cache.max_total_tokens
        max_running = server_args.scheduler.max_running_requests
        context_length = min(server_args.model.context_length or FAKE_CONTEXT_LENGTH, max_total_tokens)
        self.req_to_token_pool = ReqToTokenPool(max_running + EXTRA_REQ_ROWS, context_length + 4)
        self.token_to_kv_pool = TokenToKVPool(max_total_tokens, 1, 1, 1, torch.float32)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(max_total_tokens)
        self.model_info = ModelInfo(
            checkpoint="scripted", architecture="ScriptedWorker", dtype="float32", device="cpu",
            vocab_size=FAKE_VOCAB_SIZE, context_length=context_length, max_total_tokens=max_total_tokens,
            max_running_requests=max_running, eos_token_ids=(FAKE_EOS_ID,),
        )
        self.num_steps = 0
        self.fail_at: set[int] = set()
        self.malformed_at: set[int] = set()
        self.non_finite_at: dict[int, set[str]] = {}
        self.kv_errors: list[str] = []
        self.step_rids: list[list[str]] = []

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationResult:
        self.num_steps += 1
        self.step_rids.append([r.rid for r in batch.reqs])
        if self.num_steps in self.fail_at:
            raise RuntimeError(f"injected failure at step {self.num_steps}")
        fb = batch.forward_batch
        self.token_to_kv_pool.set_kv_buffer(
            0, fb.out_cache_loc, fb.input_ids.view(-1, 1, 1).float(), fb.positions.view(-1, 1, 1).float()
        )
        self._check_kv(batch)
        sampled = [batch.reqs[i] for i in batch.sample_rows]
        tokens = [self.scripts[r.rid][len(r.output_ids)] for r in sampled]
        if self.num_steps in self.malformed_at:
            tokens = tokens[:-1]
        poisoned = self.non_finite_at.get(self.num_steps, set())
        invalid = tuple(j for j, r in enumerate(sampled) if r.rid in poisoned)
        return GenerationResult(tokens, [None] * len(tokens), [None] * len(batch.reqs), invalid_rows=invalid)

    def _check_kv(self, batch: ModelWorkerBatch) -> None:
        k, v = self.token_to_kv_pool.get_kv_buffer(0)
        for req, row, seq_len in zip(batch.reqs, batch.forward_batch.req_pool_indices.tolist(),
                                     batch.forward_batch.seq_lens_cpu):
            slots = self.req_to_token_pool.req_to_token[row, :seq_len].long()
            if k[slots].flatten().long().tolist() != req.fill_ids[:seq_len]:
                self.kv_errors.append(f"step {self.num_steps}: {req.rid} reads another request's KV")
            if v[slots].flatten().long().tolist() != list(range(seq_len)):
                self.kv_errors.append(f"step {self.num_steps}: {req.rid} reads KV of wrong positions")


def create_fake_scheduler(scripts: dict[str, list[int]], **overrides) -> Scheduler:
    """A scheduler over a `ScriptedWorker` (see there) with a small pool unless overridden."""
    kwargs = dict(max_total_tokens=512, max_running_requests=8, device="cpu")
    kwargs.update(overrides)
    server_args = ServerArgs.from_kwargs(**kwargs)
    return Scheduler(server_args, worker=ScriptedWorker(server_args, scripts), tokenizer=LetterTokenizer())
