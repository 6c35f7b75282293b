"""Rejection sampling of drafts keeps the target's sampling distribution (chi-square tests).

The target is a tiny random Llama (32-token vocabulary, so every bin is
well filled): its next-token logits after a prompt (row 0) and after the
prompt + the draft token (row 1). Thousands of requests, each with its own
seed, verify the same one-token draft in one step; the first emitted token
must follow the sampler's distribution at row 0 whatever the draft, and the
token after an accepted draft the distribution at row 1.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from arborlm.runtime.sampling import Sampler, SamplingBatchInfo, make_generator
from arborlm.runtime.sampling_filters import filter_probs
from arborlm.runtime.schedule_batch import Req
from arborlm.runtime.speculative.verify import DraftVerifier
from arborlm.sampling_params import SamplingParams

VOCAB = 32
PROMPT = [1, 5, 9, 3]
NUM_REQS = 4000


@pytest.fixture(scope="module")
def target_logits() -> torch.Tensor:
    """(2, VOCAB) float32: the tiny model's logits after PROMPT and after PROMPT + its argmax."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, initializer_range=0.3,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        first = model(torch.tensor([PROMPT])).logits[0, -1]
        draft = int(first.argmax())
        second = model(torch.tensor([PROMPT + [draft]])).logits[0, -1]
    return torch.stack([first, second]).float()


def make_reqs(n: int, **sampling) -> list[Req]:
    params = SamplingParams(**sampling).normalized()
    params.verify(VOCAB)
    return [Req(rid=f"r{i}", origin_input_ids=list(PROMPT), sampling_params=params, seed=i) for i in range(n)]


def sampler_probs(logits: torch.Tensor, **sampling) -> torch.Tensor:
    """What a plain decode step samples from: softmax(logits / T), filtered, normalised."""
    params = SamplingParams(**sampling).normalized()
    info = SamplingBatchInfo.from_params([params] * logits.shape[0], [0] * logits.shape[0], VOCAB)
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    probs = filter_probs(probs, info)
    return probs / probs.sum(dim=-1, keepdim=True)


def chi_square_ok(counts: Counter, probs: torch.Tensor, total: int) -> tuple[bool, float, float]:
    """Pearson's test at p = 0.001: bins expecting < 5 draws are pooled; the critical value
    is the Wilson-Hilferty approximation of the chi-square quantile."""
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for token_id, p in enumerate(probs.tolist()):
        expected = p * total
        if expected < 5:
            pooled_obs += counts.get(token_id, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(token_id, 0) - expected) ** 2 / expected
        dof += 1
    if pooled_exp >= 5:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    elif pooled_obs > 10:  # tokens the filters remove (probability 0) were drawn
        return False, stat, 0.0
    z = 3.09  # one-sided 0.001
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < critical, stat, critical


def verify(reqs: list[Req], draft: list[int], logits: torch.Tensor):
    rows = logits[: len(draft) + 1].repeat(len(reqs), 1)
    return DraftVerifier(VOCAB, lambda req: [2]).verify(reqs, [list(draft)] * len(reqs), rows)


@pytest.mark.parametrize("sampling", [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.3, "top_k": 6},
], ids=["t1", "t0.7-top_p", "t1.3-top_k"])
@pytest.mark.parametrize("which", ["likely", "unlikely"])
def test_emitted_tokens_follow_the_target_distribution(target_logits, sampling, which):
    probs = sampler_probs(target_logits, **sampling)
    draft = int(probs[0].argmax()) if which == "likely" else int(target_logits[0].argmin())
    out = verify(make_reqs(NUM_REQS, **sampling), [draft], target_logits)
    firsts, seconds, offset = Counter(), Counter(), 0
    for n in out.accept_lens:
        tokens = out.token_ids[offset : offset + n]
        offset += n
        firsts[tokens[0]] += 1
        if n == 2:
            assert tokens[0] == draft
            seconds[tokens[1]] += 1
    ok, stat, critical = chi_square_ok(firsts, probs[0], NUM_REQS)
    assert ok, f"first token: chi2 {stat:.1f} >= {critical:.1f}"
    accepted = sum(seconds.values())
    assert accepted == firsts[draft] or which == "unlikely"
    assert abs(accepted / NUM_REQS - float(probs[0, draft])) < 0.03
    if which == "likely":
        ok, stat, critical = chi_square_ok(seconds, probs[1], accepted)
        assert ok, f"token after the accepted draft: chi2 {stat:.1f} >= {critical:.1f}"


def test_the_same_seed_gives_the_same_tokens_whatever_the_batch(target_logits):
    draft = [int(target_logits[0].argmax())]
    reqs = make_reqs(64, temperature=1.0)
    alone = [verify([req], draft, target_logits) for req in make_reqs(64, temperature=1.0)]
    batched = verify(list(reversed(reqs)), draft, target_logits)
    tokens, offset = [], 0
    for n in batched.accept_lens:
        tokens.append(batched.token_ids[offset : offset + n])
        offset += n
    assert list(reversed(tokens)) == [a.token_ids for a in alone]
    assert len({tuple(t) for t in tokens}) > 1  # the seeds differ, so do the samples


def plain_decode_draws(seed: int, logits: torch.Tensor, n: int, **sampling) -> list[int]:
    """The first ``n`` tokens plain decode steps would draw at rows 0.. of ``logits`` with this
    seed: the decode step's `Sampler`, one row a step, on the request's generator."""
    params = SamplingParams(**sampling).normalized()
    generator = make_generator(seed)
    out = []
    for j in range(n):
        info = SamplingBatchInfo.from_params([params], [seed], VOCAB, generators=[generator])
        out.append(int(Sampler()(logits[j : j + 1].clone(), info, return_logprob=False).next_token_ids[0]))
    return out


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}], ids=["t1", "top_p"])
def test_emitted_tokens_are_speculation_offs_draws_whatever_the_draft(target_logits, sampling):
    """The drafts of a sampled request depend on its batch (other requests' outputs, the step's
    budget, the adaptive switch); its tokens must not: with any draft, or none, a seed emits the
    tokens plain decode steps draw with it (the token after an accepted draft too)."""
    probs = sampler_probs(target_logits, **sampling)
    likely, unlikely = int(probs[0].argmax()), int(target_logits[0].argmin())
    accepted = 0
    for seed in range(300):
        plain = plain_decode_draws(seed, target_logits, 2, **sampling)
        for draft in ([likely], [unlikely], []):
            [req] = make_reqs(1, **sampling)
            req.seed = seed
            out = verify([req], draft, target_logits)
            want = plain[:2] if draft and plain[0] == draft[0] else plain[:1]
            assert out.token_ids == want, f"seed {seed}, draft {draft}"
            accepted += len(out.token_ids) == 2
    assert accepted > 50  # the likely draft was accepted often enough to test the second token
