"""Speculative decoding in the scheduler alone: a scripted target, real pools and radix cache.

`SpecScriptedWorker` plays a target model whose greedy output of request
`rid` is `scripts[rid]`: on a verify step it returns, for each request, the
longest prefix of its draft that equals the script plus the next script token
(greedy acceptance), exactly what a real target's argmax would give. Every run
checks the pool invariants after each step (`run_to_completion`), that each
request reads only KV of its own tokens at its own positions, and that every
KV slot and request row is back at the end; outputs must equal the script, so
speculation may change how many steps a request takes, never its tokens.

Time is scripted too: the worker advances a `ScriptedClock` by
`scripted_step_seconds` of each step it runs, and the speculator's cost-aware
switch reads that clock, so whether a step drafts never depends on this
machine's speed.
"""

from __future__ import annotations

import random

import pytest

from arborlm.runtime.config import ServerArgs
from arborlm.runtime.model_worker import GenerationResult, ModelWorkerBatch
from arborlm.runtime.scheduler import Scheduler
from arborlm.runtime.speculative.adaptive import AdaptivePolicy
from arborlm.runtime.speculative.verify import accept_greedy
from tests.runtime.scheduler_helpers import (
    LetterTokenizer,
    ScriptedWorker,
    make_req,
    run_to_completion,
)


def copy_script(rid: str, length: int = 80) -> list[int]:
    """A request's output: phrases of its prompt and of a shared block, repeated (copy-heavy)."""
    rng = random.Random(rid)
    phrases = [[rng.randrange(10, 1000) for _ in range(rng.randint(3, 8))] for _ in range(4)] + [SHARED]
    out: list[int] = []
    while len(out) < length:
        out.extend(rng.choice(phrases))
    return out[:length]


SHARED = [700, 701, 702, 703, 704, 705]


def prompt_for(rid: str) -> list[int]:
    """The prompt: the start of the request's own script (so its phrases recur in the output)."""
    return copy_script(rid, 24)


class ScriptedClock:
    """Seconds that pass only when the scripted worker says so (`advance`)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def scripted_step_seconds(num_rows: int) -> float:
    """A step's scripted time: a fixed part (the weights read once) plus a part per row."""
    return 0.010 + 0.001 * num_rows


class SpecScriptedWorker(ScriptedWorker):
    """`ScriptedWorker` that also verifies drafts (see the module docstring); each step
    advances `clock` by ``step_seconds(rows)`` (rows: tokens the step runs)."""

    def __init__(self, server_args: ServerArgs, scripts: dict[str, list[int]]):
        super().__init__(server_args, scripts)
        self.num_verify_steps = 0
        self.fail_verify_at: set[int] = set()  # verify steps (1-based) that raise
        self.clock = ScriptedClock()
        self.step_seconds = scripted_step_seconds

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationResult:
        self.clock.advance(self.step_seconds(len(batch.forward_batch.input_ids)))
        if batch.draft_tokens is None:
            return super().forward_batch_generation(batch)
        self.num_steps += 1
        self.num_verify_steps += 1
        if self.num_verify_steps in self.fail_verify_at:
            raise RuntimeError(f"injected failure at verify step {self.num_verify_steps}")
        fb = batch.forward_batch
        self.token_to_kv_pool.set_kv_buffer(
            0, fb.out_cache_loc, fb.input_ids.view(-1, 1, 1).float(), fb.positions.view(-1, 1, 1).float()
        )
        tokens, lens = [], []
        for req, draft, seq_len in zip(batch.reqs, batch.draft_tokens, fb.seq_lens_cpu):
            self._check_chain(req, draft, seq_len)
            script = self.scripts[req.rid]
            done = len(req.output_ids)
            targets = script[done : done + len(draft) + 1]
            n = accept_greedy(draft, targets)
            tokens.extend(targets[:n])
            lens.append(n)
        return GenerationResult(tokens, [None] * len(tokens), [None] * len(batch.reqs), accept_lens=lens)

    def _check_chain(self, req, draft: list[int], seq_len: int) -> None:
        """The row holds the request's own tokens, then the draft, at their positions."""
        k, v = self.token_to_kv_pool.get_kv_buffer(0)
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, :seq_len].long()
        if k[slots].flatten().long().tolist() != req.fill_ids + draft:
            self.kv_errors.append(f"verify step {self.num_steps}: {req.rid} reads another request's KV")
        if v[slots].flatten().long().tolist() != list(range(seq_len)):
            self.kv_errors.append(f"verify step {self.num_steps}: {req.rid} reads KV of wrong positions")


def create_spec_scheduler(scripts, **overrides) -> Scheduler:
    kwargs = dict(max_total_tokens=512, max_running_requests=8, device="cpu", speculative_algorithm="NGRAM",
                  speculative_num_draft_tokens=5)
    kwargs.update(overrides)
    server_args = ServerArgs.from_kwargs(**kwargs)
    sched = Scheduler(server_args, worker=SpecScriptedWorker(server_args, scripts), tokenizer=LetterTokenizer())
    if sched.speculator is not None:
        sched.speculator.policy = AdaptivePolicy(clock=sched.worker.clock)
    return sched


RIDS = [f"r{i}" for i in range(6)]
LENGTHS = [40, 17, 1, 33, 60, 2]


def run(sched, lengths=LENGTHS, **sampling):
    reqs = [make_req(rid, prompt_for(rid), max_new_tokens=n, ignore_eos=True, **sampling)
            for rid, n in zip(RIDS, lengths)]
    return run_to_completion(sched, reqs)


@pytest.mark.parametrize("overrides", [
    {},
    {"speculative_num_draft_tokens": 1},
    {"chunked_prefill_size": 8, "max_prefill_tokens": 8},
    {"disable_radix_cache": True},
    {"speculative_ngram_min_match_window_size": 1, "speculative_ngram_max_match_window_size": 1},
], ids=["defaults", "one-draft-token", "chunked", "no-radix-cache", "unigram"])
def test_outputs_follow_the_script_with_fewer_steps(overrides):
    """Each request gets exactly its script up to max_new_tokens (cut exactly inside an
    accepted run), reads only its own KV, and drafts were accepted."""
    scripts = {rid: copy_script(rid) for rid in RIDS}
    sched = create_spec_scheduler(scripts, **overrides)
    result = run(sched)
    for rid, n in zip(RIDS, LENGTHS):
        assert result.tokens[rid] == scripts[rid][:n], rid
        assert result.finish[rid] == {"type": "length", "length": n}
    assert sched.worker.kv_errors == []
    info = sched.get_info()
    assert info["spec_num_accepted_tokens"] > 0
    assert info["avg_spec_accept_length"] > 1.0
    assert info["num_generated_tokens"] == sum(LENGTHS)
    off = create_spec_scheduler(scripts, **{**overrides, "speculative_algorithm": None})
    assert run(off).steps > result.steps


def test_retraction_under_a_tiny_pool_keeps_the_script():
    """A pool too small for every request: drafts take only leftover slots, retracted
    requests resume, and the tokens still follow the script."""
    scripts = {rid: copy_script(rid) for rid in RIDS}
    sched = create_spec_scheduler(scripts, max_total_tokens=110, init_new_token_ratio=0.05,
                                  min_new_token_ratio=0.0, new_token_ratio_decay=0.0)
    result = run(sched, lengths=[60] * len(RIDS))
    assert sched.stats["num_retractions"] > 0
    assert sched.get_info()["spec_num_accepted_tokens"] > 0
    for rid in RIDS:
        assert result.tokens[rid] == scripts[rid][:60], rid
    assert sched.worker.kv_errors == []


def test_stop_token_inside_an_accepted_run_ends_there():
    """A stop token id the target emits in the middle of accepted drafts ends the request
    on it; the tokens after it are not emitted and their KV is freed."""
    scripts = {rid: copy_script(rid) for rid in RIDS}
    stop_at = {rid: 20 + i for i, rid in enumerate(RIDS)}
    reqs = [make_req(rid, prompt_for(rid), max_new_tokens=70, stop_token_ids=[scripts[rid][stop_at[rid]]])
            for rid in RIDS]
    sched = create_spec_scheduler(scripts)
    result = run_to_completion(sched, reqs)
    for rid in RIDS:
        first = scripts[rid].index(scripts[rid][stop_at[rid]])
        assert result.tokens[rid] == scripts[rid][: first + 1]
        assert result.finish[rid]["type"] == "stop"
    assert sched.get_info()["spec_num_accepted_tokens"] > 0


def test_stop_string_cuts_accepted_tokens_exactly():
    """A stop string completed by an accepted draft token ends the request at that token."""
    scripts = {rid: copy_script(rid) for rid in RIDS}
    tok = LetterTokenizer()
    stops = {rid: tok.decode(scripts[rid][30:33]) for rid in RIDS}
    reqs = [make_req(rid, prompt_for(rid), max_new_tokens=70, ignore_eos=True, stop=[stops[rid]]) for rid in RIDS]
    off = create_spec_scheduler(scripts, speculative_algorithm=None)
    want = run_to_completion(off, [make_req(r.rid, r.input_ids, max_new_tokens=70, ignore_eos=True,
                                            stop=[stops[r.rid]]) for r in reqs])
    sched = create_spec_scheduler(scripts)
    result = run_to_completion(sched, reqs)
    assert result.tokens == want.tokens
    assert result.finish == want.finish
    assert all(f["type"] == "stop" for f in result.finish.values())


def test_abort_mid_speculation_frees_every_slot():
    """Requests aborted while they speculate finish with `abort`; their slots and rows come back."""
    scripts = {rid: copy_script(rid, 200) for rid in RIDS}
    sched = create_spec_scheduler(scripts)
    for rid in RIDS:
        sched.add_request(make_req(rid, prompt_for(rid), max_new_tokens=150, ignore_eos=True))
    finish = {}
    for step in range(400):
        if step == 12:
            for rid in RIDS[:3]:
                sched.abort_request(rid)
        for out in sched.step():
            if out.finish_reason:
                finish[out.rid] = out.finish_reason["type"]
        sched.check_invariants()
        if not sched.has_work():
            break
    assert finish == {rid: "abort" if rid in RIDS[:3] else "length" for rid in RIDS}
    assert sched.worker.num_verify_steps > 0
    sched.check_invariants()
    assert sched.allocator.available_size() + sched.tree_cache.total_size() == sched.allocator.size


def test_a_failed_verify_step_aborts_its_requests_alone():
    """A worker failure on a verify step aborts that step's requests and frees the chain's slots."""
    scripts = {rid: copy_script(rid) for rid in RIDS}
    sched = create_spec_scheduler(scripts)
    sched.worker.fail_verify_at = {2}
    result = run(sched)
    aborted = {rid for rid, f in result.finish.items() if f["type"] == "abort"}
    assert aborted, "the failed verify step aborted nobody"
    for rid, n in zip(RIDS, LENGTHS):
        if rid not in aborted:
            assert result.tokens[rid] == scripts[rid][:n]


def test_large_batches_do_not_draft():
    """With `speculative_disable_by_batch_size` requests decoding, no step drafts."""
    scripts = {rid: copy_script(rid) for rid in RIDS}
    sched = create_spec_scheduler(scripts, speculative_disable_by_batch_size=2)
    result = run(sched, lengths=[40] * len(RIDS))
    info = sched.get_info()
    assert info["spec_num_skipped_batches"] > 0
    for rid in RIDS:
        assert result.tokens[rid] == scripts[rid][:40]


def test_meta_counts_reach_the_output():
    """Each request counts its verify steps and accepted draft tokens."""
    scripts = {rid: copy_script(rid) for rid in RIDS}
    sched = create_spec_scheduler(scripts)
    reqs = [make_req(rid, prompt_for(rid), max_new_tokens=40, ignore_eos=True) for rid in RIDS]
    result = run_to_completion(sched, reqs)
    last = {rid: outs[-1] for rid, outs in result.outputs.items()}
    assert sum(o.spec_accepted_tokens for o in last.values()) == sched.get_info()["spec_num_accepted_tokens"]
    assert all(o.spec_verify_ct >= 1 for o in last.values())
    # Each step's output carries one token of the target plus the drafts it accepted.
    for rid, outs in result.outputs.items():
        steps_with_tokens = sum(1 for o in outs if o.new_token_ids)
        assert len(result.tokens[rid]) == steps_with_tokens + last[rid].spec_accepted_tokens


def test_bookkeeping_that_raises_frees_every_chain(monkeypatch):
    """A verify step whose bookkeeping raises (a grammar or detokenizer bug, say) aborts
    that step's requests; every chain slot of the step comes back."""
    scripts = {rid: copy_script(rid) for rid in RIDS}
    sched = create_spec_scheduler(scripts)
    append = sched.append_token
    calls = {"n": 0}

    def flaky(req, token_id):
        if sched.worker.num_verify_steps == 3:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected bookkeeping failure")
        return append(req, token_id)

    monkeypatch.setattr(sched, "append_token", flaky)
    result = run(sched)
    assert calls["n"] >= 2
    assert any(f["type"] == "abort" for f in result.finish.values())
