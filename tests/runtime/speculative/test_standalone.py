"""STANDALONE speculation (a draft model) on the tiny random Llama: greedy output equals speculation off.

The target is the conftest's 2-layer random Llama (float32); drafts are (a) the
target truncated to its first layer, (b) the target itself (every draft token
must then be accepted) and (c) an unrelated random Llama with the same
tokenizer (many rejections). Every run checks the target's pool invariants
after each step and that every target slot and row is back at the end
(`run_to_completion`), and then that the draft's pool is whole again too.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest
import torch

from arborlm.errors import ModelLoadError
from arborlm.runtime.config import ServerArgs
from tests.conftest import TOKENIZER_FILES
from tests.runtime.scheduler_helpers import create_scheduler, make_req, run_to_completion
from tests.runtime.speculative.test_spec_model import copy_prompts

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10},
                   "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "maxItems": 4}},
    "required": ["name", "tags"],
}


def _copy_tokenizer(src, dst) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            (dst / name).write_bytes((src / name).read_bytes())


@pytest.fixture(scope="module")
def truncated_draft(tiny_llama_dir, tmp_path_factory):
    """The target's embeddings, first decoder layer and final norm: a 1-layer draft."""
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("draft_1layer")
    LlamaForCausalLM.from_pretrained(str(tiny_llama_dir), num_hidden_layers=1).save_pretrained(folder)
    _copy_tokenizer(tiny_llama_dir, folder)
    return folder


@pytest.fixture(scope="module")
def random_draft(tiny_llama_dir, tmp_path_factory):
    """An unrelated random 1-layer Llama (untied head) with the target's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("draft_random")
    config = LlamaConfig(vocab_size=49152, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(7)
    LlamaForCausalLM(config).save_pretrained(folder)
    _copy_tokenizer(tiny_llama_dir, folder)
    return folder


def standalone(tiny_llama_dir, tiny_tokenizer, draft, num_steps=3, **overrides):
    # Every draft verified (the cost-aware switch off): the counts below must not depend on timings.
    overrides.setdefault("speculative_adaptive", False)
    return create_scheduler(tiny_llama_dir, tiny_tokenizer, speculative_algorithm="STANDALONE",
                            speculative_draft_model_path=str(draft), speculative_num_steps=num_steps, **overrides)


def assert_draft_pool_whole(sched) -> None:
    draft = sched.worker.draft_worker
    draft.check_invariants()
    assert not draft.states
    assert draft.allocator.available_size() == draft.allocator.size
    assert draft.req_to_token_pool.available_size() == draft.req_to_token_pool.size


def both(sched, reqs_fn, between=None):
    """Run the same requests with speculation off (no speculator, no draft prefill), then on;
    the scheduler's `check_invariants` after every step of the second run checks the draft's
    pool too (every draft slot and row free or held by a request that holds a target row)."""
    speculator, draft_worker = sched.speculator, sched.worker.draft_worker
    sched.speculator = sched.worker.draft_worker = None
    off = run_to_completion(sched, reqs_fn())
    sched.speculator, sched.worker.draft_worker = speculator, draft_worker
    assert sched.flush_cache()
    on = run_to_completion(sched, reqs_fn()) if between is None else between(sched, reqs_fn())
    assert_draft_pool_whole(sched)
    return off, on


def test_greedy_identity_with_a_truncated_draft(tiny_llama_dir, tiny_tokenizer, truncated_draft):
    """Ragged copy-heavy prompts, some with logprobs: the same tokens, finish reasons and target
    logprobs, in fewer steps; the draft ran and its rejected slots went back."""
    prompts = copy_prompts(3)

    def reqs():
        out = [make_req(f"r{i}", p, max_new_tokens=14 + 5 * i) for i, p in enumerate(prompts)]
        for req in out[::2]:
            req.return_logprob, req.top_logprobs_num = True, 2
        return out

    sched = standalone(tiny_llama_dir, tiny_tokenizer, truncated_draft)
    off, on = both(sched, reqs)
    assert on.tokens == off.tokens
    assert on.finish == off.finish
    assert on.steps < off.steps
    assert sched.get_info()["spec_num_accepted_tokens"] > 0
    for rid in off.tokens:
        lp_off = [lp for o in off.outputs[rid] for lp in o.output_token_logprobs]
        lp_on = [lp for o in on.outputs[rid] for lp in o.output_token_logprobs]
        assert [t for _, t in lp_on] == [t for _, t in lp_off]
        assert [v for v, _ in lp_on] == pytest.approx([v for v, _ in lp_off], abs=1e-4)


def test_a_draft_equal_to_the_target_is_always_accepted(tiny_llama_dir, tiny_tokenizer):
    """Draft == target (same weights): every draft token is accepted, each verify step emits
    num_steps + 1 tokens unless max_new_tokens cuts it."""
    prompts = copy_prompts(2, seed=4)
    sched = standalone(tiny_llama_dir, tiny_tokenizer, tiny_llama_dir, num_steps=4)
    off, on = both(sched, lambda: [make_req(f"r{i}", p, max_new_tokens=21, ignore_eos=True)
                                   for i, p in enumerate(prompts)])
    assert on.tokens == off.tokens
    info = sched.get_info()
    assert info["spec_num_draft_tokens"] > 0
    assert info["spec_num_accepted_tokens"] == info["spec_num_draft_tokens"]
    assert info["spec_accept_rate"] == 1.0
    # 21 tokens: 1 from prefill, then 4 verify steps of 5 tokens each.
    assert info["spec_num_verify_steps"] == 4


def test_greedy_identity_with_many_rejections(tiny_llama_dir, tiny_tokenizer, random_draft):
    """An unrelated random draft: rejected drafts are freed at once, the tokens stay the same."""
    prompts = copy_prompts(2, seed=5)
    sched = standalone(tiny_llama_dir, tiny_tokenizer, random_draft, num_steps=5)
    off, on = both(sched, lambda: [make_req(f"r{i}", p, max_new_tokens=16, ignore_eos=True)
                                   for i, p in enumerate(prompts)])
    assert on.tokens == off.tokens
    info = sched.get_info()
    assert info["spec_num_verify_steps"] > 0
    assert info["spec_num_accepted_tokens"] < info["spec_num_draft_tokens"]


def test_json_schema_stop_strings_and_max_new_tokens(tiny_llama_dir, tiny_tokenizer, truncated_draft):
    """Constrained, stop-string and length-cut requests: the same tokens and finish reasons;
    the constrained output stops and validates."""
    prompts = copy_prompts(4, seed=6)
    sched = standalone(tiny_llama_dir, tiny_tokenizer, truncated_draft)
    probe = run_to_completion(sched, [make_req("probe", prompts[1], max_new_tokens=20, ignore_eos=True)])
    text = tiny_tokenizer.decode(probe.tokens["probe"])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop
    assert sched.flush_cache()

    def reqs():
        return [make_req("json", prompts[0], max_new_tokens=40, json_schema=json.dumps(SCHEMA)),
                make_req("stop", prompts[1], max_new_tokens=20, ignore_eos=True, stop=[stop]),
                make_req("len", prompts[2], max_new_tokens=7, ignore_eos=True),
                make_req("plain", prompts[3], max_new_tokens=12)]

    off, on = both(sched, reqs)
    assert on.tokens == off.tokens
    assert on.finish == off.finish
    assert on.finish["stop"]["type"] == "stop"
    assert len(on.tokens["len"]) == 7
    assert on.finish["json"]["type"] == "stop"
    jsonschema.validate(json.loads(tiny_tokenizer.decode(on.tokens["json"], skip_special_tokens=True)), SCHEMA)
    assert on.outputs["json"][-1].finish_reason is not None
    assert sched.get_info()["spec_num_accepted_tokens"] > 0


def test_greedy_identity_under_kv_pressure_and_retraction(tiny_llama_dir, tiny_tokenizer, truncated_draft):
    """A target pool too small for the batch: retraction mid-speculation releases the draft's KV of
    the retracted requests; the tokens stay the same."""
    prompts = copy_prompts(4, seed=1)
    sched = standalone(tiny_llama_dir, tiny_tokenizer, truncated_draft, max_total_tokens=110,
                       init_new_token_ratio=0.05, min_new_token_ratio=0.0, new_token_ratio_decay=0.0)
    off, on = both(sched, lambda: [make_req(f"r{i}", p, max_new_tokens=20, ignore_eos=True)
                                   for i, p in enumerate(prompts)])
    assert sched.stats["num_retractions"] > 0
    assert sched.get_info()["spec_num_accepted_tokens"] > 0
    assert on.tokens == off.tokens


def test_a_draft_pool_too_small_for_the_batch(tiny_llama_dir, tiny_tokenizer, truncated_draft):
    """The draft's pool holds less than the batch's tokens: requests take turns in it (the others'
    draft KV is dropped and caught up later), the tokens stay the same and nothing leaks."""
    from arborlm.radix_cache.memory_pool import TokenToKVPoolAllocator

    prompts = copy_prompts(3, seed=2)
    sched = standalone(tiny_llama_dir, tiny_tokenizer, truncated_draft)
    draft = sched.worker.draft_worker
    draft.allocator = TokenToKVPoolAllocator(max(len(p) for p in prompts) + 8)
    off, on = both(sched, lambda: [make_req(f"r{i}", p, max_new_tokens=12, ignore_eos=True)
                                   for i, p in enumerate(prompts)])
    assert on.tokens == off.tokens
    assert sched.get_info()["spec_num_accepted_tokens"] > 0


def test_abort_mid_run_frees_the_draft_kv(tiny_llama_dir, tiny_tokenizer, truncated_draft):
    """A request aborted after a few verify steps ends as an abort; the others' tokens are
    unchanged and both pools are whole afterwards."""
    prompts = copy_prompts(3, seed=8)

    def reqs():
        return [make_req(f"r{i}", p, max_new_tokens=20, ignore_eos=True) for i, p in enumerate(prompts)]

    def abort_midway(sched, batch):
        for req in batch:
            sched.add_request(req)
        for _ in range(4):
            sched.step()
        assert sched.worker.draft_worker.states, "the draft holds KV mid-run"
        sched.abort_request("r1")
        return run_to_completion(sched, [])

    sched = standalone(tiny_llama_dir, tiny_tokenizer, truncated_draft)
    off, on = both(sched, reqs, between=abort_midway)
    assert on.finish["r1"]["type"] == "abort"
    for rid in ("r0", "r2"):
        assert off.tokens[rid][-len(on.tokens[rid]):] == on.tokens[rid]


def test_sampled_requests_are_seed_deterministic(tiny_llama_dir, tiny_tokenizer, truncated_draft):
    """Temperature > 0 (rejection sampling, the greedy draft a point mass): a draft depends on the
    request's own tokens only, so the same seeds give the same tokens together or one by one."""
    prompts = copy_prompts(2, seed=3)

    def reqs():
        return [make_req(f"s{i}", p, seed=100 + i, temperature=0.7, top_k=8, max_new_tokens=14, ignore_eos=True)
                for i, p in enumerate(prompts)]

    sched = standalone(tiny_llama_dir, tiny_tokenizer, truncated_draft)
    together = run_to_completion(sched, reqs())
    assert sched.get_info()["spec_num_accepted_tokens"] > 0
    for req in reqs():
        alone = run_to_completion(sched, [req])
        assert alone.tokens[req.rid] == together.tokens[req.rid]
    assert_draft_pool_whole(sched)


def test_a_failing_draft_model_decodes_without_drafts(tiny_llama_dir, tiny_tokenizer, truncated_draft,
                                                      monkeypatch):
    """The draft model raising (prefill or drafting) costs the requests nothing but speed."""
    prompts = copy_prompts(2, seed=9)
    sched = standalone(tiny_llama_dir, tiny_tokenizer, truncated_draft)

    def broken(forward_batch):
        raise RuntimeError("injected draft failure")

    monkeypatch.setattr(sched.worker.draft_worker.runner, "forward", broken)
    off, on = both(sched, lambda: [make_req(f"r{i}", p, max_new_tokens=8) for i, p in enumerate(prompts)])
    assert on.tokens == off.tokens
    assert on.finish == off.finish
    assert sched.get_info()["spec_num_verify_steps"] == 0


@pytest.mark.parametrize("kwargs, name, error", [
    ({"speculative_algorithm": "STANDALONE"}, "speculative_draft_model_path", ValueError),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "/x"}, "speculative_draft_model_path",
     ValueError),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/x", "speculative_num_steps": 0},
     "speculative_num_steps", ValueError),
    ({"speculative_num_steps": 65}, "speculative_num_steps", ValueError),
    ({"speculative_num_steps": 2.5}, "speculative_num_steps", TypeError),
    ({"speculative_draft_model_path": 3}, "speculative_draft_model_path", TypeError),
])
def test_bad_arguments(kwargs, name, error):
    with pytest.raises(error, match=name):
        ServerArgs.from_kwargs(**kwargs)


def test_a_draft_with_another_tokenizer_is_refused(tiny_llama_dir, tiny_tokenizer, tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    LlamaForCausalLM.from_pretrained(str(tiny_llama_dir), num_hidden_layers=1).save_pretrained(tmp_path)
    other = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    other.add_tokens(["<only_in_the_draft>"])
    other.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="speculative_draft_model_path.*tokenizer differs"):
        standalone(tiny_llama_dir, tiny_tokenizer, tmp_path)


def test_serve_with_a_draft_of_another_tokenizer_exits_cleanly(tiny_llama_dir, tmp_path):
    """`arborlm serve` whose scheduler refuses the draft: a usage error naming the argument,
    nothing else on stderr (the scheduler process exits by itself; killed, it left a semaphore
    to the resource tracker's "leaked semaphore" warning)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    LlamaForCausalLM.from_pretrained(str(tiny_llama_dir), num_hidden_layers=1).save_pretrained(tmp_path)
    other = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    other.add_tokens(["<only_in_the_draft>"])
    other.save_pretrained(tmp_path)
    out = subprocess.run([sys.executable, "-m", "arborlm", "serve", "--model-path", str(tiny_llama_dir),
                          "--port", "0", "--speculative-algorithm", "STANDALONE",
                          "--speculative-draft-model-path", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    assert "arborlm serve: error: speculative_draft_model_path=" in out.stderr and "tokenizer differs" in out.stderr
    assert "leaked" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_draft_that_fails_to_load_stops_start_up(tiny_llama_dir, tiny_tokenizer, tmp_path):
    """A missing draft and an unloadable one (no weights): ModelLoadError while the worker is built,
    before the scheduler exists (the launcher re-raises it from the scheduler process)."""
    with pytest.raises(ModelLoadError, match="speculative_draft_model_path=.*no-such-draft"):
        standalone(tiny_llama_dir, tiny_tokenizer, tmp_path / "no-such-draft")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    _copy_tokenizer(tiny_llama_dir, broken)
    with pytest.raises(ModelLoadError, match="speculative_draft_model_path|safetensors|weights"):
        standalone(tiny_llama_dir, tiny_tokenizer, broken)
