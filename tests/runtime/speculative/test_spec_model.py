"""Speculation on a real model: greedy output token-identical to speculation off.

The tiny random Llama (float32) runs every case in-process; the default model
(SmolLM2, float32 weights) runs one copy-heavy chat prompt. Every run checks
the pool invariants after each step and that every slot and row is back at the
end (`run_to_completion`); each test also asserts that drafts were accepted, so
the verify path really ran.
"""

from __future__ import annotations

import random

import pytest

from tests.runtime.scheduler_helpers import create_scheduler, make_req, run_to_completion


def copy_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat their own phrases (what prompt lookup feeds on)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrases = [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 7))] for _ in range(3)]
        out.append([t for _ in range(rng.randint(3, 6)) for t in rng.choice(phrases)])
    return out


def both(make, reqs_fn, **overrides):
    """Run the same requests with speculation off and on; returns both results and the scheduler.

    One scheduler (one model load) serves both runs: its `speculator` is set aside for the
    first, and the radix cache is emptied between them.
    """
    sched = make(speculative_algorithm="NGRAM", **overrides)
    speculator, sched.speculator = sched.speculator, None
    off = run_to_completion(sched, reqs_fn())
    sched.speculator = speculator
    assert sched.flush_cache()
    on = run_to_completion(sched, reqs_fn())
    return off, on, sched


@pytest.fixture
def make_tiny(tiny_llama_dir, tiny_tokenizer):
    # Every draft verified (the cost-aware switch off): the tiny model's step counts and accepted
    # drafts must not depend on this machine's timings.
    return lambda **kw: create_scheduler(tiny_llama_dir, tiny_tokenizer, **{"speculative_adaptive": False, **kw})


def test_greedy_identity_on_the_tiny_model(make_tiny):
    """A batch of ragged copy-heavy prompts: the same tokens, finish reasons and logprobs
    (of the target, within float noise), in fewer steps."""
    prompts = copy_prompts(5)

    def reqs():
        out = [make_req(f"r{i}", p, max_new_tokens=24 + 5 * i) for i, p in enumerate(prompts)]
        for req in out[::2]:
            req.return_logprob, req.top_logprobs_num = True, 2
        return out

    off, on, sched = both(make_tiny, reqs)
    assert on.tokens == off.tokens
    assert on.finish == off.finish
    info = sched.get_info()
    assert info["spec_num_accepted_tokens"] > 0
    assert on.steps < off.steps
    for rid in off.tokens:
        lp_off = [lp for o in off.outputs[rid] for lp in o.output_token_logprobs]
        lp_on = [lp for o in on.outputs[rid] for lp in o.output_token_logprobs]
        assert [t for _, t in lp_on] == [t for _, t in lp_off]
        assert [v for v, _ in lp_on] == pytest.approx([v for v, _ in lp_off], abs=1e-4)
        top_off = [top for o in off.outputs[rid] for top in o.output_top_logprobs]
        top_on = [top for o in on.outputs[rid] for top in o.output_top_logprobs]
        assert [[t for _, t in row] for row in top_on] == [[t for _, t in row] for row in top_off]


def test_greedy_identity_under_kv_pressure_and_retraction(make_tiny):
    """A pool too small for the batch: retraction mid-speculation, the same tokens."""
    prompts = copy_prompts(5, seed=1)

    def reqs():
        return [make_req(f"r{i}", p, max_new_tokens=30, ignore_eos=True) for i, p in enumerate(prompts)]

    off, on, sched = both(make_tiny, reqs, max_total_tokens=130, init_new_token_ratio=0.05,
                          min_new_token_ratio=0.0, new_token_ratio_decay=0.0)
    assert sched.stats["num_retractions"] > 0
    assert sched.get_info()["spec_num_accepted_tokens"] > 0
    assert on.tokens == off.tokens


def test_penalties_and_min_new_tokens_see_the_drafted_tokens(make_tiny):
    """Repetition/frequency penalties and min_new_tokens at each draft position count the
    drafts before it, as a decode step would have."""
    prompts = copy_prompts(3, seed=2)

    def reqs():
        return [make_req("pen", prompts[0], max_new_tokens=20, repetition_penalty=1.3, frequency_penalty=0.4),
                make_req("min", prompts[1], max_new_tokens=20, min_new_tokens=15),
                make_req("plain", prompts[2], max_new_tokens=20)]

    off, on, sched = both(make_tiny, reqs)
    assert on.tokens == off.tokens
    assert sched.get_info()["spec_num_accepted_tokens"] > 0


def test_sampled_requests_equal_speculation_off(make_tiny):
    """Temperature > 0 with drafts: the same seeds give the tokens speculation off gives them,
    together and one by one, before and after other requests filled the cross-request index
    (greedy answers to the same prompts, which the sampled requests then draft from): a draft
    changes how many tokens a step emits, never which."""
    prompts = copy_prompts(3, seed=3)

    def sampled(prefix):
        return [make_req(f"{prefix}{i}", p, seed=100 + i, temperature=0.5, top_k=4, max_new_tokens=20, ignore_eos=True)
                for i, p in enumerate(prompts)]

    def tokens(result):
        return {rid[1:]: t for rid, t in result.tokens.items()}

    off, on, sched = both(make_tiny, lambda: sampled("a"))
    assert tokens(on) == tokens(off)
    assert sched.get_info()["spec_num_accepted_tokens"] > 0
    warm = [make_req(f"g{i}", p, max_new_tokens=20, ignore_eos=True) for i, p in enumerate(prompts)]
    run_to_completion(sched, warm)
    assert len(sched.speculator.drafter.recent) > 0  # the other requests' outputs are indexed
    beside_greedy = run_to_completion(
        sched, sampled("b") + [make_req(f"h{i}", p, max_new_tokens=20, ignore_eos=True) for i, p in enumerate(prompts)])
    assert {rid[1:]: t for rid, t in beside_greedy.tokens.items() if rid[0] == "b"} == tokens(off)
    assert tokens(run_to_completion(sched, sampled("c"))) == tokens(off)
    alone = {rid[1:]: t for req in sampled("d") for rid, t in run_to_completion(sched, [req]).tokens.items()}
    assert alone == tokens(off)


def test_greedy_identity_on_the_default_model(smollm_dir):
    """SmolLM2 asked to repeat a paragraph: the same text, and most of it from accepted drafts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm_dir))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Repeat this sentence exactly: the radix cache shares every common "
                                     "prefix across calls, and grammar masks keep JSON valid."}],
        add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text)

    def reqs():
        return [make_req("copy", ids, max_new_tokens=28)]

    def make(**kw):
        return create_scheduler(smollm_dir, tok, quantization="none", max_total_tokens=1024, **kw)

    off, on, sched = both(make, reqs)
    assert on.tokens == off.tokens
    info = sched.get_info()
    assert info["avg_spec_accept_length"] > 2.0
    assert on.steps < off.steps


def test_json_extraction_drafts_from_the_prompt_text_on_the_default_model(smollm_dir, monkeypatch):
    """SmolLM2 copying a record's values into JSON: the values tokenize unlike the prompt's
    (after a quote), the prompt lookup on text drafts them, and the output is the same tokens
    as without speculation and validates."""
    import json

    import jsonschema
    from transformers import AutoTokenizer

    from arborlm.runtime.speculative.ngram import TextLookup

    tok = AutoTokenizer.from_pretrained(str(smollm_dir))
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
              "required": ["name", "city"]}
    records = [("Alan Turing", "Manchester"), ("Grace Hopper", "New York")]
    prompts = [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"Record: name: {name}; city: {city}\nGive this record as JSON with "
                                     "the keys name and city, copying the values."}],
        add_generation_prompt=True, tokenize=False)) for name, city in records]
    drafted = []

    def counting(propose):
        def wrapped(self, tokenizer, tokens, num_draft_tokens):
            draft = propose(self, tokenizer, tokens, num_draft_tokens)
            drafted.append(len(draft))
            return draft
        return wrapped

    # Both text sources: a value after its key, and the text suffix inside a value.
    monkeypatch.setattr(TextLookup, "propose", counting(TextLookup.propose))
    monkeypatch.setattr(TextLookup, "propose_value", counting(TextLookup.propose_value))

    def reqs():
        return [make_req(f"r{i}", ids, max_new_tokens=40, json_schema=json.dumps(schema)) for i, ids in enumerate(prompts)]

    def make(**kw):
        return create_scheduler(smollm_dir, tok, quantization="none", max_total_tokens=1024,
                                speculative_adaptive=False, **kw)

    off, on, sched = both(make, reqs)
    assert on.tokens == off.tokens
    for rid in on.tokens:
        assert on.finish[rid]["type"] == "stop"
        value = json.loads(tok.decode(on.tokens[rid], skip_special_tokens=True))
        jsonschema.validate(value, schema)
    assert sum(drafted) > 0, "the text lookup drafted nothing"
    assert sched.get_info()["spec_num_accepted_tokens"] > 0


def test_jump_forward_tokens_run_with_a_draft_after_them_on_the_default_model(smollm_dir, monkeypatch):
    """A key the grammar forces is not an extend step of its own under NGRAM: its tokens
    run in a verify step with the draft after them (here the value another record's output
    had after the same key), the forced rows need no verification, and the output is the
    same tokens as without speculation, valid, in fewer steps, every slot back."""
    import json

    import jsonschema
    from transformers import AutoTokenizer

    from arborlm.runtime.speculative import scheduling

    tok = AutoTokenizer.from_pretrained(str(smollm_dir))
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
              "required": ["name", "city"]}
    records = [("Alan Turing", "London"), ("Grace Hopper", "London"), ("Ada Lovelace", "London")]
    prompts = [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"Record: name: {name}; city: {city}\nGive this record as JSON with "
                                     "the keys name and city, copying the values."}],
        add_generation_prompt=True, tokenize=False)) for name, city in records]
    chains = []  # (tokens run before the draft, draft length) of every chain of a verify step
    build = scheduling.build_verify_batch

    def recording(reqs, drafts, *args):
        chains.extend((scheduling.pending_len(r), len(d)) for r, d in zip(reqs, drafts))
        return build(reqs, drafts, *args)

    monkeypatch.setattr(scheduling, "build_verify_batch", recording)

    def reqs():
        return [make_req(f"r{i}", ids, max_new_tokens=40, json_schema=json.dumps(schema)) for i, ids in enumerate(prompts)]

    sched = create_scheduler(smollm_dir, tok, quantization="none", max_total_tokens=1024,
                             speculative_algorithm="NGRAM", speculative_adaptive=False)
    off, on = one_after_another(sched, reqs, before_on=chains.clear)
    assert on.tokens == off.tokens
    for rid, ids in on.tokens.items():
        assert on.finish[rid]["type"] == "stop"
        jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), schema)
    jumps = [(pending, n) for pending, n in chains if pending > 1]
    assert jumps, "no forced tokens ran in a verify step"
    assert any(n > 0 for _, n in jumps), "no draft followed forced tokens"
    assert sched.stats["num_jump_forward_steps"] >= len(jumps) > 0
    assert on.steps < off.steps
    assert sched.get_info()["spec_num_accepted_tokens"] > 0

    # Drafting off by batch size: the jumps still run as verify chains without drafts, the
    # output is the same, and no speculative statistic counts them.
    import dataclasses

    sched.speculator.config = dataclasses.replace(sched.speculator.config, speculative_disable_by_batch_size=1)
    assert sched.flush_cache()
    chains.clear()
    before = sched.get_info()
    plain = run_one_by_one(sched, reqs())
    assert plain.tokens == off.tokens
    assert any(pending > 1 for pending, _ in chains) and not any(n for _, n in chains)
    after = sched.get_info()
    for key in ("spec_num_verify_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens"):
        assert after[key] == before[key], key


class RunResultLike:
    """Tokens, finish reasons and steps of several `run_to_completion` calls together."""

    def __init__(self):
        self.tokens, self.finish, self.steps = {}, {}, 0


def run_one_by_one(sched, reqs) -> RunResultLike:
    """Run ``reqs`` one at a time (the later ones drafting from the earlier outputs)."""
    total = RunResultLike()
    for req in reqs:
        one = run_to_completion(sched, [req])
        total.tokens.update(one.tokens)
        total.finish.update(one.finish)
        total.steps += one.steps
    return total


def one_after_another(sched, reqs_fn, before_on=None) -> tuple[RunResultLike, RunResultLike]:
    """`run_one_by_one` of ``reqs_fn()`` with speculation off, then on, the radix cache emptied
    between; ``before_on`` is called just before the second run. Returns (off, on)."""
    speculator, sched.speculator = sched.speculator, None
    off = run_one_by_one(sched, reqs_fn())
    sched.speculator = speculator
    assert sched.flush_cache()
    if before_on is not None:
        before_on()
    return off, run_one_by_one(sched, reqs_fn())


def test_sampled_json_with_jump_forward_equals_speculation_off_on_the_default_model(smollm_dir, monkeypatch):
    """Temperature 0.8 under a JSON schema whose keys jump-forward forces: a token that forces a
    jump cuts the tokens drawn after it in the same verify step, and the request's generator
    goes back to its state after the kept tokens' draws (speculation off draws nothing for the
    forced key), so each seed gives speculation off's tokens (a fresh-user check found 7 of
    24 seeds equal before), and valid JSON."""
    import json

    import jsonschema
    from transformers import AutoTokenizer

    from arborlm.runtime.speculative import scheduling

    tok = AutoTokenizer.from_pretrained(str(smollm_dir))
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"name": {"type": "string"}, "born": {"type": "string"}, "city": {"type": "string"},
                             "occupation": {"type": "string"}, "married": {"type": "boolean"}},
              "required": ["name", "born", "city", "occupation", "married"]}
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Extract the fields of this record as JSON: name: Alan Turing; born: "
                                     "1912-06-23; city: London; occupation: mathematician; married: false"}],
        add_generation_prompt=True, tokenize=False))

    rewound = []
    rewind = scheduling.rewind_draws

    def recording(req, kept, states):
        rewound.append(bool(states and kept and not req.finished and len(kept) < len(states)))
        rewind(req, kept, states)

    monkeypatch.setattr(scheduling, "rewind_draws", recording)

    def reqs():
        return [make_req(f"s{seed}", prompt, seed=seed, temperature=0.8, max_new_tokens=60,
                         json_schema=json.dumps(schema)) for seed in range(1, 5)]

    sched = create_scheduler(smollm_dir, tok, quantization="none", max_total_tokens=2048,
                             speculative_algorithm="NGRAM", speculative_adaptive=False)
    off, on = one_after_another(sched, reqs)
    assert any(rewound), "no verify step cut drawn tokens at a jump: the case is not tested"
    assert on.tokens == off.tokens
    for rid, ids in on.tokens.items():
        if on.finish[rid]["type"] == "stop":
            jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), schema)
