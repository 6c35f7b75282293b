"""The decode step's sampling fast paths against their torch oracles (issue 25).

`SamplingInfoCache` must give exactly what `SamplingBatchInfo.from_params` gives each step,
and the sampler's one max pass must pick what `torch.argmax` picks and flag the same rows
as unsampleable.
"""

import pytest
import torch

from arborlm.runtime.sampling import (
    Sampler,
    SamplingBatchInfo,
    SamplingInfoCache,
    SamplingParams,
    invalid_logit_rows,
    make_generator,
)

VOCAB = 64


def _params(**kw):
    p = SamplingParams(**kw)
    p.verify(VOCAB)
    return p


def test_cache_reuses_only_the_same_requests():
    cache = SamplingInfoCache()
    params = [_params(temperature=0), _params(temperature=0.7, top_p=0.9)]
    gens = [make_generator(1), make_generator(2)]
    first = cache.get(params, [1, 2], VOCAB, "cpu", gens)
    assert cache.get(list(params), [1, 2], VOCAB, "cpu", list(gens)) is first
    # Another order, another request, an equal but distinct params object: rebuilt.
    assert cache.get(params[::-1], [2, 1], VOCAB, "cpu", gens[::-1]) is not first
    equal = [_params(temperature=0), params[1]]
    rebuilt = cache.get(equal, [1, 2], VOCAB, "cpu", gens)
    assert rebuilt is not first and rebuilt.params_list[0] is equal[0]
    assert cache.get(params[:1], [1], VOCAB, "cpu", gens[:1]).batch_size == 1
    assert cache.get(params, [1, 2], 2 * VOCAB, "cpu", gens).vocab_size == 2 * VOCAB


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.0, 1.0, -1), (0.8, 0.9, -1), (1.0, 1.0, 5)])
def test_cached_info_samples_as_a_fresh_one_each_step(temperature, top_p, top_k):
    """Ten steps of a batch sampled through the cache equal ten steps with `from_params`
    rebuilt every step (same seeds), so the kept generators continue their streams."""
    params = [_params(temperature=temperature, top_p=top_p, top_k=top_k, seed=s) for s in (3, 4, 5)]
    seeds = [3, 4, 5]
    cached_gens = [make_generator(s) for s in seeds]
    fresh_gens = [make_generator(s) for s in seeds]
    cache, sampler = SamplingInfoCache(), Sampler()
    for step in range(10):
        logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(step))
        a = sampler(logits, cache.get(params, seeds, VOCAB, "cpu", cached_gens), return_logprob=False)
        b = sampler(logits, SamplingBatchInfo.from_params(params, seeds, VOCAB, "cpu", fresh_gens),
                    return_logprob=False)
        assert torch.equal(a.next_token_ids, b.next_token_ids)


def test_greedy_single_pass_matches_argmax_and_flags_bad_rows():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = logits[1, 40] = logits[1].max() + 1  # a tie: the first maximum wins, as argmax
    logits[2, 3] = float("nan")
    logits[3, 5] = float("inf")
    logits[4] = float("-inf")  # every token masked
    info = SamplingBatchInfo.from_params([_params(temperature=0)] * 6, list(range(6)), VOCAB)
    out = Sampler()(logits, info, return_logprob=False)
    assert out.invalid_rows == (2, 3, 4) == invalid_logit_rows(logits)
    good = [0, 1, 5]
    assert out.next_token_ids[good].tolist() == torch.argmax(logits[good], dim=-1).tolist()
    assert out.next_token_ids[1].item() == 7
