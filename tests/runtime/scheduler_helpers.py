"""Small factories for scheduler tests (in the manner of vLLM's `create_requests`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from arborlm.runtime.config import ServerArgs
from arborlm.runtime.io_struct import ReqOutput, TokenizedGenerateReqInput
from arborlm.runtime.scheduler import Scheduler
from arborlm.sampling_params import SamplingParams


def create_scheduler(model_dir, tokenizer, **overrides) -> Scheduler:
    """A scheduler on `model_dir` in float32 with a small KV pool unless overridden."""
    kwargs = dict(model=str(model_dir), dtype="float32", max_total_tokens=4096, device="cpu")
    kwargs.update(overrides)
    return Scheduler(ServerArgs.from_kwargs(**kwargs), tokenizer=tokenizer)


def make_req(rid: str, input_ids: list[int], seed: int = 0, **sampling) -> TokenizedGenerateReqInput:
    sampling.setdefault("temperature", 0.0)
    params = SamplingParams(**sampling).normalized()
    params.verify(49152)
    return TokenizedGenerateReqInput(rid=rid, input_ids=list(input_ids), sampling_params=params, seed=seed)


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
